"""Fault: user code that reaches past its reward process: a return value that runs code when rebuilt, a tree of
processes that holds more memory than the limit together, children that leave the session, and a reward that
reads the run's secrets or writes into its directory.

What the reward sandbox promises (docs/architecture/trust.md, "User code"), each tested here with real processes:

* a reward's return value comes back as data: nothing it returns is unpickled in the manager, and a value that
  is not data fails its sample with an error that names it;
* ``worker.reward.memory_limit_mb`` bounds the whole tree of a reward process (proportional set sizes, measured
  every ``POLL_S``), and the tree may hold at most ``max_processes`` processes;
* a timeout kills the whole tree, children that called ``setsid`` or double-forked included, and what a call
  leaves running is killed when it returns (what the module started at import lives on);
* a reward runs in a scratch directory with an allowlisted environment plus ``worker.reward.env``.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from helpers.processes import alive

from vlmrl.reward.function import RewardFunctionError
from vlmrl.reward.manager import SequentialFunctionRewardManager
from vlmrl.reward.sandbox import Sandbox, Status


def _write(tmp_path: Path, source: str, name: str = "reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _wait_dead(pids: list[int], seconds: float = 10.0) -> list[int]:
    """The pids still alive after ``seconds`` (killed here, so that a failing test leaves nothing behind)."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _run(sandbox: Sandbox, payloads: list) -> list:
    try:
        return sandbox.run(payloads, chunk_size=1, stop=lambda o: False)
    finally:
        sandbox.close()


# ----------------------------------------------------------------------------- 17: results as data

_EVIL = """
    import os

    class Evil:
        # Unpickling this calls os.mkdir(path): code of the user's choosing, run wherever it is unpickled.
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return (os.mkdir, (self.path,))

    def score(x, mark):
        if x["sample_id"] == 1:
            return {"overall": Evil(mark)}
        return {"overall": 1.0}

    def write_to_pipe(x, mark):
        # Past the protocol: pickle the object straight onto the pipe to the manager.
        import sys
        from multiprocessing.connection import Connection
        Connection(int(sys.argv[2]), readable=False).send(["ok", x["sample_id"], {"overall": Evil(mark)}])
        return {"overall": 1.0}
"""


def test_a_reward_value_that_would_run_code_when_unpickled_fails_its_sample_and_runs_nothing(tmp_path):
    mark = tmp_path / "ran-in-the-manager"
    spec = _write(tmp_path, _EVIL) + ":score"
    manager = SequentialFunctionRewardManager(spec, {"mark": str(mark)}, num_cpus=1, timeout=60)
    inputs = [{"response": "r", "sample_id": i, "data_source": "geo"} for i in range(2)]
    try:
        with pytest.raises(RewardFunctionError) as info:
            manager.compute(inputs)
    finally:
        manager.close()
    assert not mark.exists(), "the reward's return value ran code in the manager"
    message = str(info.value)
    assert "raised on sample 1 (data source 'geo')" in message, message
    assert "cannot be sent back" in message and "Evil is not plain data" in message, message


def test_a_reward_that_writes_a_pickle_onto_the_pipe_runs_nothing_and_its_call_fails(tmp_path):
    mark = tmp_path / "ran-in-the-manager"
    spec = _write(tmp_path, _EVIL) + ":write_to_pipe"
    [outcome] = _run(Sandbox(spec, {"mark": str(mark)}, processes=1, timeout=60), [{"sample_id": 0}])
    assert not mark.exists(), "a pickle written to the pipe ran code in the manager"
    assert outcome.status is Status.died, outcome
    assert "sent the manager something that is not data" in outcome.value, outcome


# ----------------------------------------------------------------------------- 18: the whole tree is bounded

_FORKING = """
    import os, time

    def score(x, pid_file):
        # Three forked children of 250 MB each: each is under the 512 MB per-process limit, all three are not.
        pids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                hoard = b"\\x01" * (250 * 1024**2)  # written, so resident
                time.sleep(600)
                os._exit(0)
            pids.append(pid)
        with open(pid_file, "w") as f:
            f.write(" ".join(map(str, pids)))
        time.sleep(600)
        return {"overall": 1.0}
"""


def test_forked_children_that_together_pass_the_memory_limit_are_killed_and_the_call_fails(tmp_path):
    pid_file = tmp_path / "pids"
    spec = _write(tmp_path, _FORKING) + ":score"
    sandbox = Sandbox(spec, {"pid_file": str(pid_file)}, processes=1, timeout=30, memory_limit_mb=512)
    start = time.monotonic()
    [outcome] = _run(sandbox, [{"response": "x"}])
    assert outcome.status is Status.died, outcome  # not timed_out: the limit, not the clock, ended it
    assert "together they held" in outcome.value and "worker.reward.memory_limit_mb=512 MB" in outcome.value
    assert time.monotonic() - start < 25
    assert _wait_dead([int(p) for p in pid_file.read_text().split()]) == []


_DETACHING = """
    import os, subprocess, time

    def score(x, pid_file):
        pids = [subprocess.Popen(["sleep", "600"], start_new_session=True).pid]  # its own session
        # A double fork: the middle process leaves the session and exits, so the last one is orphaned.
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                time.sleep(600)
            os._exit(0)
        os.waitpid(middle, 0)
        pids.append(int(os.read(read, 32)))
        with open(pid_file, "w") as f:
            f.write(" ".join(map(str, pids)))
        if x["response"] == "hang":
            time.sleep(600)
        return {"overall": 1.0}
"""


def test_children_that_left_the_session_are_dead_after_the_timeout(tmp_path):
    pid_file = tmp_path / "pids"
    spec = _write(tmp_path, _DETACHING) + ":score"
    [outcome] = _run(Sandbox(spec, {"pid_file": str(pid_file)}, processes=1, timeout=3), [{"response": "hang"}])
    assert outcome.status is Status.timed_out, outcome
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    assert _wait_dead(pids) == [], "a detached child of a timed-out reward outlived the kill"


def test_what_a_call_leaves_running_is_killed_when_it_returns(tmp_path):
    pid_file = tmp_path / "pids"
    spec = _write(tmp_path, _DETACHING) + ":score"
    sandbox = Sandbox(spec, {"pid_file": str(pid_file)}, processes=1, timeout=60)
    try:
        [outcome] = sandbox.run([{"response": "return"}], chunk_size=1, stop=lambda o: False)
        assert outcome.status is Status.ok, outcome
        pids = [int(p) for p in pid_file.read_text().split()]
        # Dead before the sandbox closes: the call's end killed them, not the close.
        assert _wait_dead(pids, seconds=2) == [], "a call's detached children outlived the call"
        assert sandbox.children[0].popen.poll() is None  # the reward process itself serves on
    finally:
        sandbox.close()


_RESIDENT = """
    import subprocess

    SERVER = subprocess.Popen(["sleep", "600"])  # started at import: lives as long as the reward process

    def score(x):
        return {"overall": 1.0, "server": SERVER.pid, "alive": SERVER.poll() is None}
"""


def test_a_process_the_module_starts_at_import_lives_as_long_as_the_reward_process(tmp_path):
    spec = _write(tmp_path, _RESIDENT) + ":score"
    sandbox = Sandbox(spec, {}, processes=1, timeout=60)
    try:
        first, second = sandbox.run([{}, {}], chunk_size=1, stop=lambda o: False)
        assert first.value["alive"] and second.value["alive"], (first, second)
    finally:
        sandbox.close()
    assert _wait_dead([first.value["server"]]) == []  # and dies with it


_MANY = """
    import os, time

    def score(x):
        for _ in range(8):
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)
        time.sleep(600)
"""


def test_a_tree_of_more_processes_than_allowed_is_killed(tmp_path):
    spec = _write(tmp_path, _MANY) + ":score"
    [outcome] = _run(Sandbox(spec, {}, processes=1, timeout=30, max_processes=4), [{}])
    assert outcome.status is Status.died, outcome
    assert "more than 4 at once" in outcome.value, outcome


_LIMITS = """
    import resource

    def score(x):
        return {"overall": 1.0, "files": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
"""


def test_open_files_are_limited(tmp_path):
    from vlmrl.reward.sandbox import MAX_OPEN_FILES

    [outcome] = _run(Sandbox(_write(tmp_path, _LIMITS) + ":score", {}, processes=1, timeout=60), [{}])
    assert outcome.value["files"] <= MAX_OPEN_FILES


# ----------------------------------------------------------------------------- 19: what user code can reach

_NOSY = """
    import os

    def score(x):
        with open("written-by-the-reward.txt", "w") as f:  # relative: lands in the scratch directory
            f.write("x")
        return {"overall": 1.0, "cwd": os.getcwd(), "env": dict(os.environ)}
"""


def test_a_reward_runs_in_a_scratch_directory_with_an_allowlisted_environment(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir, _NOSY, "nosy.py")
    monkeypatch.chdir(run_dir)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("VLMRL_E2E_API_KEY", "vlmrl-secret-value")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # A relative spec is read from the run's directory, as before.
    sandbox = Sandbox("nosy.py:score", {}, processes=1, timeout=60, env={"JUDGE_API_KEY": "passed-on-purpose"})
    [outcome] = _run(sandbox, [{}])
    assert outcome.status is Status.ok, outcome
    cwd, env = Path(outcome.value["cwd"]), outcome.value["env"]
    assert cwd != run_dir and cwd.name.startswith("vlmrl-reward-")
    assert not (run_dir / "written-by-the-reward.txt").exists()
    assert not cwd.exists(), "the scratch directory outlived the sandbox"
    assert "WANDB_API_KEY" not in env and "VLMRL_E2E_API_KEY" not in env
    assert env["JUDGE_API_KEY"] == "passed-on-purpose"
    assert env["HF_HOME"] == str(tmp_path / "hf") and env["PATH"] == os.environ["PATH"]
    assert env["TMPDIR"] == str(cwd)


def test_a_module_spec_imports_from_the_runs_directory(tmp_path, monkeypatch):
    package = tmp_path / "myrewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _write(package, "def score(x):\n    return {'overall': 2.0}\n", "geo.py")
    monkeypatch.chdir(tmp_path)
    [outcome] = _run(Sandbox("myrewards.geo:score", {}, processes=1, timeout=60), [{}])
    assert outcome.value == {"overall": 2.0}, outcome
