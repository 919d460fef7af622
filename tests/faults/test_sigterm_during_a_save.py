"""Fault: SIGTERM arrives while a periodic checkpoint is being saved.

The run used to notice the request only at the next step, so it trained and
saved one more whole step inside the scheduler's grace period. Now it stops
right after the save that was under way.
"""

from __future__ import annotations

import sys

import pytest
from helpers.runs import REPO, SMALL, experiment_dir, main_command, read_metrics, run_command


@pytest.mark.e2e
def test_a_stop_requested_during_a_save_stops_right_after_it(tiny_assets, tmp_path):
    command = [sys.executable, str(REPO / "tests" / "helpers" / "stop_in_save.py"), "2"]
    command += main_command(tmp_path, *SMALL, "trainer.max_steps=50", "trainer.save_freq=2", "trainer.logger=[console,file]")[3:]
    proc = run_command(command)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2], output[-3000:]
    checkpoints = experiment_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_2"]
    assert (checkpoints / "global_step_2" / "COMPLETE").is_file()
    assert "stop requested: saved step 2, exiting" in output
