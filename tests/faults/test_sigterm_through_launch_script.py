"""Fault: SIGTERM sent to a launch script's shell (what Slurm, Kubernetes and ``docker stop`` do).

The scripts used to run python as a child of bash, which does not pass SIGTERM
on: the driver never heard it, and the scheduler SIGKILLed it after its grace
period, losing the steps since the last save. With ``exec`` the driver is the
shell's process. Checked for every script (the driver replaces the shell and
gets the signal), and end to end once: SIGTERM to a launch script's pid gives a
saved checkpoint and exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.runs import REPO, experiment_dir, read_metrics

SCRIPTS = sorted((REPO / "examples").glob("*.sh"))

# Stands in for python: records its pid, then waits for SIGTERM and records that it came.
_RECORDER = """#!/usr/bin/env bash
trap 'echo TERM > "$OUT/signal"; exit 0' TERM
echo $$ > "$OUT/pid"
while true; do sleep 0.1; done
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_driver_replaces_the_shell_and_gets_its_sigterm(script, tmp_path):
    recorder = tmp_path / "python"
    recorder.write_text(_RECORDER)
    recorder.chmod(0o755)
    proc = subprocess.Popen(["bash", str(script)], env={**os.environ, "PYTHON": str(recorder), "OUT": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").is_file() or not (tmp_path / "pid").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "the script did not start python"
            time.sleep(0.05)
        assert int((tmp_path / "pid").read_text()) == proc.pid, "python runs as a child of the shell (no exec)"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "signal").read_text().strip() == "TERM"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.e2e
def test_sigterm_to_a_launch_scripts_shell_saves_and_exits_zero(sigterm_run):
    """examples/qwen2_5_vl_3b_geo3k_grpo.sh, pointed at the tiny quickstart on the CPU, stopped by SIGTERM to the
    shell's pid (tests/helpers/sigterm_run.py; the run is shared with tests/test_resume.py)."""
    output = sigterm_run.output
    assert sigterm_run.returncode == 0, output[-5000:]
    last = read_metrics(sigterm_run.out)[-1]["step"]
    assert last < 200
    assert (experiment_dir(sigterm_run.out) / "checkpoints" / f"global_step_{last}" / "COMPLETE").is_file(), output[-5000:]
    assert "stop requested" in output
