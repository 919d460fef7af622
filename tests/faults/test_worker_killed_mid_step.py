"""Fault: a training worker is killed with SIGKILL in the middle of a run (an OOM kill, a lost node).

The run must fail, not hang, and the same command must resume from the last
complete checkpoint and finish, with every step logged once after the resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.runs import REPO, SMALL, experiment_dir, main_command, run_main, tail

STEPS = 4
ARGS = (*SMALL, f"trainer.max_steps={STEPS}", "trainer.save_freq=1", "trainer.logger=[console,file]")


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _worker_of(driver: int) -> int | None:
    """The pid of this run's training worker (a process of the run's own local Ray cluster)."""
    for pid in _descendants(driver):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if name.startswith("ray::HybridWorker") or name.startswith("ray::hybrid_worker"):
            return pid
    return None


@pytest.mark.e2e
def test_a_run_whose_worker_is_killed_fails_and_the_same_command_resumes(tiny_assets, tmp_path):
    log = tmp_path / "log.txt"
    checkpoint_1 = experiment_dir(tmp_path) / "checkpoints" / "global_step_1" / "COMPLETE"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with log.open("w") as sink:
        proc = subprocess.Popen(main_command(tmp_path, *ARGS), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 400
        while not checkpoint_1.is_file():
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        worker = _worker_of(proc.pid)
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
