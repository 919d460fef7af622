"""The local Ray cluster a run starts: its worker processes run at the driver's priority, not 15 below it with
Ray's own daemons above them, preempting their compute threads at every wakeup."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from vlmrl.launch import LOCAL_CLUSTER_SYSTEM_CONFIG

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray

    system_config = json.loads(sys.argv[1])
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR",
             _system_config=system_config)
    print("nice", ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()))
    ray.shutdown()
    """
)


def _worker_niceness(system_config: dict) -> int:
    import json

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(system_config)], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return int(next(line for line in proc.stdout.splitlines() if line.startswith("nice ")).split()[1])


def test_the_runs_cluster_starts_workers_at_the_drivers_niceness_not_15_below():
    own = os.nice(0)  # the driver's, as the user's shell started it; Ray's increment adds to it
    assert _worker_niceness({}) == min(own + 15, 19)  # Ray's default: the setting below is what changes it
    assert _worker_niceness(LOCAL_CLUSTER_SYSTEM_CONFIG) == own
