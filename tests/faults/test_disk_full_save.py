"""Fault: the disk fills during a save (``OSError(ENOSPC)`` once a step's files are written).

The run must fail naming the error, remove the save's full-size temporary
directory, and leave the previous checkpoint complete.
"""

from __future__ import annotations

import sys

import pytest
from helpers.runs import REPO, SMALL, experiment_dir, main_command, run_command


@pytest.mark.e2e
def test_a_save_onto_a_full_disk_fails_cleanly_and_keeps_the_previous_checkpoint(tiny_assets, tmp_path):
    command = [sys.executable, str(REPO / "tests" / "helpers" / "full_disk_in_save.py"), "2"]
    command += main_command(tmp_path, *SMALL, "trainer.max_steps=3", "trainer.save_freq=1", "trainer.logger=[console]")[3:]
    proc = run_command(command)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "No space left on device (injected)" in output
    assert "the save failed; removing its temporary directory" in output
    checkpoints = experiment_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_1"], output[-4000:]
    assert (checkpoints / "global_step_1" / "COMPLETE").is_file()
