"""Fault: a second run on a directory a live run holds, and a lock left by a run that was SIGKILLed.

Two runs in one experiment or checkpoint directory would delete each other's
checkpoints and share metrics.jsonl and mlflow.db. The second must fail at once
(before Ray starts), naming the holder; a lock whose holder is dead is taken over.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers.runs import REPO, SMALL, experiment_dir, main_command

from vlmrl.driver.run_lock import LOCK_FILE, RunLock, RunLocked, _start_time, run_locks

_HOLD = (
    "import sys, time\n"
    "from vlmrl.driver.run_lock import RunLock\n"
    "lock = RunLock(sys.argv[1], 'experiment directory'); lock.acquire()\n"
    "print('held', flush=True); time.sleep(600)\n"
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding the experiment directory of a run named "run" under tmp_path."""
    directory = experiment_dir(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_fails_at_once_naming_the_holder(holder, tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        main_command(tmp_path, *SMALL, "trainer.max_steps=1"), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by another vlmrl run (pid {holder.pid} on host {socket.gethostname()}" in proc.stderr
    assert "trainer.experiment_name" in proc.stderr  # the fix
    assert "Ray" not in proc.stdout + proc.stderr  # refused before Ray started
    assert elapsed < 120, elapsed
    # The holder's lock is untouched.
    assert json.loads((experiment_dir(tmp_path) / LOCK_FILE).read_text())["pid"] == holder.pid


def test_a_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    with RunLock(tmp_path, "experiment directory"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over {tmp_path / LOCK_FILE} from a run that is gone (pid {dead.pid}" in capsys.readouterr().out
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end of the run


def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path):
    # The pid is alive (this process's parent), but it started at another time than the lock says: a reused pid.
    parent = os.getppid()
    assert _start_time(parent) is not None
    stale = {"pid": parent, "host": socket.gethostname(), "start_time": "1", "started": "before a reboot"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with RunLock(tmp_path, "experiment directory"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_held_from_another_host_is_never_taken_over(tmp_path):
    held = {"pid": 1234, "host": "some-other-node", "started": "now"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(held))
    with pytest.raises(RunLocked, match="pid 1234 on host some-other-node.*remove the lock file"):
        RunLock(tmp_path, "experiment directory").acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == held


def test_a_checkpoint_directory_outside_the_experiment_is_locked_too(tmp_path):
    experiment, checkpoints = tmp_path / "exp", tmp_path / "shared_checkpoints"
    with run_locks(experiment, checkpoints):
        assert (experiment / LOCK_FILE).is_file() and (checkpoints / LOCK_FILE).is_file()
        with pytest.raises(RunLocked, match="checkpoint directory .*shared_checkpoints is in use"):
            with run_locks(tmp_path / "another_exp", checkpoints):
                pass
    assert not (experiment / LOCK_FILE).exists() and not (checkpoints / LOCK_FILE).exists()
