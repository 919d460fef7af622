"""One local Ray cluster for the test session, which the suite's CLI runs join instead of each starting its own.

Each ``python -m vlmrl.main`` run that starts its own cluster pays for it: a
child process of its own session, Ray's daemons (gcs_server, the raylet, the
agents) and their shutdown. The runs of ``helpers.runs.run_main`` and
``run_command`` join this one instead, through ``RAY_ADDRESS``, as a user's
driver joins a cluster that ``ray start`` made; each run is still its own Ray
job, with its own runtime_env, so its worker output goes to its own run.log.

The cluster is started by a holder process (``python shared_cluster.py``), not
in pytest's process: the tests that call ``ray.init`` and ``ray.shutdown``
in-process keep their own, and pytest's environment gets no ``RAY_ADDRESS``, so
the runs a test starts with ``subprocess`` directly (the signal, process-group,
run-lock and loopback tests) start clusters of their own as before. The holder
starts it as a run starts its local cluster (``vlmrl.launch``: loopback only,
the same system config, Ray's token authentication), started on first use and
stopped when its stdin closes: at the session's end, or when pytest dies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

FORKSERVER = Path(__file__).resolve().parents[1] / "forkserver" / "vlmrl_forkserver.py"
FORKSERVER_DIR = "VLMRL_FORKSERVER_DIR"
"""In a joining run's environment: the fork server's directory (its socket and token)."""

NUM_CPUS = 32
"""Logical CPUs: more than any one run places (workers, rollout servers, reward actors), with room for the actors
of the job before, which Ray releases a moment after that job's driver exits."""

DISABLE_ENV = "VLMRL_TESTS_OWN_CLUSTERS"
"""Set to 1 to have every run start a cluster of its own again (to compare, or to rule the sharing out)."""

FORKSERVER_ENV = "VLMRL_TESTS_FORKSERVER"
"""Set to 0 to have the joining runs' drivers and Ray workers, and the workers of the tests' own local clusters, start
cold (tests/forkserver: to compare, or to rule the fork server out)."""

_lock = threading.Lock()
_holder: subprocess.Popen | None = None
_forkserver: subprocess.Popen | None = None
_forkserver_dir: str | None = None
_env: dict[str, str] = {}


def join_env(forked: bool = True) -> dict[str, str]:
    """What a run's environment needs to join the session's cluster (started on first call), and, ``forked``, to
    start its workers through the fork server; {} when disabled."""
    global _holder, _env
    if os.environ.get(DISABLE_ENV) == "1":
        return {}
    with _lock:
        if _holder is None or _holder.poll() is not None:  # not started yet, or gone: start one
            _holder, _env = _start()
        return {**_env, **(_forkserver_env() if forked else {})}


def forkserver_pid() -> int | None:
    """The fork server's pid while it runs, else None."""
    with _lock:
        return _forkserver.pid if _forkserver is not None and _forkserver.poll() is None else None


def forked_runtime_env() -> dict:
    """The runtime_env for a test's own ``ray.init``: the job's workers start as forks of the session's fork
    server ({} when it is disabled)."""
    with _lock:
        env = _forkserver_env()
    return {"py_executable": f"{sys.executable} {FORKSERVER} --connect {env[FORKSERVER_DIR]}"} if env else {}


def _forkserver_env() -> dict[str, str]:
    """With the lock held: what a driver needs to have its workers forked (the server started on first call)."""
    global _forkserver, _forkserver_dir
    if os.environ.get(FORKSERVER_ENV, "1") == "0":
        return {}
    if _forkserver is None or _forkserver.poll() is not None:
        _forkserver_dir = tempfile.mkdtemp(prefix="vlmrl-fork-")
        # pytest's environment: the children take on their clients' own, but OpenMP reads its settings when the
        # server loads torch (vlmrl_forkserver.py says what else differs from a cold start).
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        log = Path(tempfile.gettempdir()) / f"vlmrl-tests-forkserver-{os.getpid()}.log"
        with open(log, "w") as sink:
            _forkserver = subprocess.Popen(
                [sys.executable, str(FORKSERVER), "--serve", _forkserver_dir], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=sink, text=True, env=env,
            )  # fmt: skip
        line = _forkserver.stdout.readline()
        _forkserver.stdout.close()
        if not line:
            _forkserver.wait()
            raise RuntimeError(
                f"the tests' fork server did not start (exit {_forkserver.returncode}):\n{log.read_text()[-4000:]}"
            )
    python_path = os.pathsep.join(p for p in (str(FORKSERVER.parent), os.environ.get("PYTHONPATH")) if p)
    return {
        FORKSERVER_DIR: _forkserver_dir,
        "RAY_RUNTIME_ENV_HOOK": f"{FORKSERVER.stem}.runtime_env_hook",
        "PYTHONPATH": python_path,
    }


def _start() -> tuple[subprocess.Popen, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Its own log: the holder outlives the test that started it, whose captured output is gone by then.
    log = Path(tempfile.gettempdir()) / f"vlmrl-tests-shared-ray-{os.getpid()}.log"
    with open(log, "w") as sink:
        holder = subprocess.Popen(
            [sys.executable, __file__, str(NUM_CPUS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
            text=True, env=env,
        )  # fmt: skip
    line = holder.stdout.readline()
    holder.stdout.close()
    if not line:
        holder.wait()
        why = log.read_text()[-4000:]
        raise RuntimeError(f"the shared Ray cluster did not start (exit {holder.returncode}):\n{why}")
    return holder, json.loads(line)


def stop() -> None:
    """Close the holder's stdin, so it shuts the cluster down, then the fork server's, and wait for them."""
    global _holder, _forkserver, _forkserver_dir
    with _lock:
        holder, _holder = _holder, None
        forkserver, _forkserver = _forkserver, None
        forkserver_dir, _forkserver_dir = _forkserver_dir, None
    # The cluster first, then the fork server: a worker the cluster stops still has a client waiting for it.
    for process, timeout in ((holder, 60), (forkserver, 30)):
        if process is None:
            continue
        process.stdin.close()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if forkserver_dir is not None:
        shutil.rmtree(forkserver_dir, ignore_errors=True)


def _hold(num_cpus: int) -> None:
    """In the holder process: start the cluster, print how to join it, and keep it up until stdin closes."""
    import ray

    from vlmrl.driver.local_cluster import LOOPBACK_ENV, loopback_only
    from vlmrl.launch import LOCAL_CLUSTER_SYSTEM_CONFIG

    with loopback_only():
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
            _system_config=LOCAL_CLUSTER_SYSTEM_CONFIG,
        )  # fmt: skip
    join = {
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        # A driver on 127.0.0.1 as well: otherwise Ray rewrites the address to the machine's own IP, where nothing
        # listens, and the driver waits for the GCS forever.
        LOOPBACK_ENV: "0",
        # ray.init turned token authentication on for the cluster (and wrote the token file a joining driver reads).
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
    }
    print(json.dumps(join), flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe any more
    sys.stdin.read()  # until pytest closes it, or dies
    ray.shutdown()


if __name__ == "__main__":
    _hold(int(sys.argv[1]))
