"""The session's fork server (tests/forkserver/vlmrl_forkserver.py): a process it forks is the process its client
stands for (arguments, directory, environment, streams, exit status, signals), with the costly modules imported, and
the Ray workers of the runs that join the session's cluster start that way, as do the processes a forked process
spawns with ``multiprocessing`` (vLLM's tensor-parallel shards)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers.processes import alive
from helpers.runs import run_command, tail
from helpers.shared_cluster import FORKSERVER, join_env

# What the forked script reports: whether it started with torch imported, its arguments, directory and an
# environment variable the server never had; then it exits with the status its first argument names.
REPORT = """\
import json, os, sys
print(json.dumps({"torch": "torch" in sys.modules, "argv": sys.argv, "cwd": os.getcwd(),
                  "only_here": os.environ.get("ONLY_HERE"), "pid": os.getpid()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]))
"""

WAIT = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
print(os.getpid(), flush=True)
time.sleep(120)
"""


# A forked process that spawns a child with multiprocessing (as vLLM starts its tensor-parallel shards): the child
# gets its arguments through spawn's pipe, answers through a queue (the resource tracker's semaphores) and exits 5.
SPAWNS = """\
import json, multiprocessing, sys


def child(queue, word):
    queue.put({"torch": "torch" in sys.modules, "word": word})
    sys.exit(5)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue, "hello"))
    process.start()
    got = queue.get(timeout=60)
    process.join(60)
    print(json.dumps({"child": got, "exitcode": process.exitcode}), flush=True)
"""


def _client(script, *args, cwd, env=None, **kwargs) -> subprocess.Popen:
    where = join_env()["VLMRL_FORKSERVER_DIR"]
    return subprocess.Popen(
        [sys.executable, str(FORKSERVER), "--connect", where, str(script), *args], cwd=cwd,
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def test_a_forked_process_is_the_one_its_client_stands_for_with_torch_already_imported(tmp_path):
    import json

    script = tmp_path / "report.py"
    script.write_text(REPORT)
    client = _client(script, "3", "b", cwd=tmp_path, env={"ONLY_HERE": "yes"})
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3, err  # the child's exit status is the client's
    report = json.loads(out)
    assert report == {
        "torch": True, "argv": [str(script), "3", "b"], "cwd": str(tmp_path), "only_here": "yes",
        "pid": report["pid"],
    }  # fmt: skip
    assert report["pid"] != client.pid  # a fork of the server, not the client exec'd
    assert "to stderr" in err


def test_a_process_a_forked_one_spawns_is_forked_too(tmp_path):
    import json

    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS)
    client = _client(script, cwd=tmp_path)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err
    # torch already imported (spawned cold, the child has only what its target's module imports), the argument
    # through spawn's pipe, the answer through the queue and the exit status through the client.
    assert json.loads(out) == {"child": {"torch": True, "word": "hello"}, "exitcode": 5}, err


def test_the_client_passes_signals_on_and_a_dead_client_takes_its_child_along(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    client = _client(script, cwd=tmp_path)
    client.stdout.readline()  # the child's pid: its handler is in place
    client.send_signal(signal.SIGTERM)
    out, _ = client.communicate(timeout=60)
    assert "got SIGTERM" in out and client.returncode == 7

    client = _client(script, cwd=tmp_path)
    child = int(client.stdout.readline())
    client.kill()
    client.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(child)


# A driver that joins the session's cluster: its actor reports whether its process started with torch imported.
DRIVER = (
    "import sys, ray; ray.init(logging_level='ERROR'); "
    "A = ray.remote(type('A', (), {'torch': lambda self: 'torch' in sys.modules})); "
    "print(ray.get(A.remote().torch.remote()))"
)


def test_the_workers_of_a_run_that_joins_the_cluster_are_forked():
    proc = run_command([sys.executable, "-c", DRIVER], timeout=120)
    assert proc.returncode == 0, tail(proc)
    assert proc.stdout.split()[-1] == "True", tail(proc)
