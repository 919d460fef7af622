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
import threading
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


def test_a_lock_of_an_older_vlmrl_held_from_another_host_is_never_taken_over(tmp_path):
    # No heartbeat_s: that holder does not beat, so its lock's age says nothing about whether it is alive.
    held = {"pid": 1234, "host": "some-other-node", "started": "now"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(held))
    long_ago = time.time() - 86400
    os.utime(tmp_path / LOCK_FILE, (long_ago, long_ago))
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


_REMOTE = {"pid": 1234, "host": "some-other-node", "started": "yesterday", "heartbeat_s": 10.0}


def test_a_lock_from_another_host_whose_heartbeat_stopped_is_taken_over_naming_the_holder(tmp_path, capsys):
    # A job rescheduled onto another node: the node that held the lock is gone, and its lock stopped beating.
    (tmp_path / LOCK_FILE).write_text(json.dumps(_REMOTE))
    silent_since = time.time() - 120
    os.utime(tmp_path / LOCK_FILE, (silent_since, silent_since))
    with RunLock(tmp_path, "experiment directory", stale_after_s=60):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert f"taking over {tmp_path / LOCK_FILE} from pid 1234 on host some-other-node, started yesterday" in out
    assert "whose heartbeat stopped 1" in out  # about 120 s ago


def test_a_lock_from_another_host_that_still_beats_is_refused(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps(_REMOTE))
    stop = threading.Event()

    def beat():  # the other node's heartbeat thread
        while not stop.wait(0.2):
            os.utime(tmp_path / LOCK_FILE)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        start = time.monotonic()
        with pytest.raises(RunLocked, match="pid 1234 on host some-other-node.*It is alive: its heartbeat goes on"):
            RunLock(tmp_path, "experiment directory", heartbeat_s=0.1, stale_after_s=5).acquire()
        assert time.monotonic() - start < 4  # told by the next beat, not by waiting out the timeout
    finally:
        stop.set()
        beating.join()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == _REMOTE


def test_a_fresh_lock_from_another_host_that_falls_silent_is_taken_over_after_the_timeout(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text(json.dumps(_REMOTE))  # beat just now, then the node died
    start = time.monotonic()
    with RunLock(tmp_path, "experiment directory", heartbeat_s=0.1, stale_after_s=1.5):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert 1.0 < time.monotonic() - start < 10
    assert "waiting up to" in capsys.readouterr().out


def test_the_holder_touches_its_lock_while_it_runs_and_stops_when_it_releases(tmp_path):
    lock = RunLock(tmp_path, "experiment directory", heartbeat_s=0.1)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat_s"] == 0.1
    long_ago = time.time() - 1000
    os.utime(tmp_path / LOCK_FILE, (long_ago, long_ago))
    time.sleep(0.5)
    assert time.time() - (tmp_path / LOCK_FILE).stat().st_mtime < 10
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    assert not any(t.name == "vlmrl-run-lock" for t in threading.enumerate())
