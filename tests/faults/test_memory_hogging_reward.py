"""Fault: a reward function that eats memory, one that leaves a child process behind when its manager is
killed, and one that kills its process at import.

Without a limit the first one grows until the kernel's OOM killer picks the
biggest process on the node, a training worker. With
``worker.reward.memory_limit_mb`` its own call fails with MemoryError, named.
A killed manager's reward processes take their own children with them. A module
that calls ``os._exit`` at import fails validation with a message instead of
ending the driver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.processes import alive
from helpers.runs import REPO

from vlmrl.config import ConfigError
from vlmrl.reward.sandbox import Sandbox, Status
from vlmrl.validate import load_config

HOG = textwrap.dedent(
    """
    def compute_score(reward_input):
        hoard = bytearray(3 * 1024**3)  # 3 GiB, past the test's 512 MB limit
        return {"overall": float(len(hoard))}
    """
)


def test_a_reward_that_eats_memory_fails_its_call_with_memory_error(tmp_path):
    (tmp_path / "hog.py").write_text(HOG)
    sandbox = Sandbox(f"{tmp_path / 'hog.py'}:compute_score", {}, processes=1, timeout=60, memory_limit_mb=512)
    try:
        [outcome] = sandbox.run([{"response": "x"}], chunk_size=1, stop=lambda o: False)
    finally:
        sandbox.close()
    assert outcome.status is Status.raised, outcome
    assert "it needed more than worker.reward.memory_limit_mb=512 MB: MemoryError" in outcome.value


def test_the_limit_is_a_validated_config_key():
    assert load_config(["config=examples/quickstart.yaml"]).worker.reward.memory_limit_mb == 8192
    with pytest.raises(ConfigError, match="worker.reward.memory_limit_mb=10: must be at least 256"):
        load_config(["config=examples/quickstart.yaml", "worker.reward.memory_limit_mb=10"])


# A manager (this script) whose reward call starts a long-lived child process, then the manager is SIGKILLed.
_MANAGER = textwrap.dedent(
    """
    import sys
    from vlmrl.reward.sandbox import Sandbox
    sandbox = Sandbox(sys.argv[1] + ":compute_score", {"pid_file": sys.argv[2]}, processes=1, timeout=None)
    sandbox.run([{"response": "x"}], chunk_size=1, stop=lambda o: False)
    """
)
_SPAWNER = textwrap.dedent(
    """
    import subprocess, time
    def compute_score(reward_input, pid_file):
        child = subprocess.Popen(["sleep", "600"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        time.sleep(600)
    """
)


def test_a_killed_managers_reward_processes_take_their_children_with_them(tmp_path):
    (tmp_path / "spawner.py").write_text(_SPAWNER)
    pid_file = tmp_path / "grandchild.pid"
    manager = subprocess.Popen([sys.executable, "-c", _MANAGER, str(tmp_path / "spawner.py"), str(pid_file)], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()):
        assert manager.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    assert alive(grandchild)
    manager.send_signal(signal.SIGKILL)
    manager.wait()
    deadline = time.monotonic() + 15
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    running = alive(grandchild)
    if running:
        os.kill(grandchild, signal.SIGKILL)
    assert not running, "the reward function's child outlived its killed manager"


def test_a_module_that_exits_at_import_fails_validation_not_the_driver(tmp_path):
    (tmp_path / "exits.py").write_text("import os\nos._exit(3)\ndef compute_score(reward_input):\n    return 0.0\n")
    probe = (
        "from vlmrl.config import ConfigError\n"
        "from vlmrl.testing.resolvers import register_resolvers\n"
        "from vlmrl.validate import load_config\n"
        "register_resolvers()\n"
        "try:\n"
        f"    load_config(['config=examples/quickstart.yaml', 'worker.reward.reward_function={tmp_path}/exits.py:compute_score', 'worker.reward.reward_function_kwargs=null'])\n"
        "except ConfigError as e:\n"
        "    print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the validating process lives on
    assert "REFUSED" in proc.stdout and "exited with code 3 while loading it" in proc.stdout, proc.stdout[-2000:]
