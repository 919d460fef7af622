"""The suite's CLI runs join one Ray cluster for the session (tests/helpers/shared_cluster.py), unless a test asks
for a cluster of its own; pytest's own environment names none, so the runs a test starts by hand start their own."""

from __future__ import annotations

import os
import sys

from helpers.runs import run_command, tail
from helpers.shared_cluster import join_env

# What a driver of the run sees: the cluster it joined, or the one it started (RAY_ADDRESS unset).
DRIVER = (
    "import os, ray; ray.init(logging_level='ERROR'); "
    "print(os.environ.get('RAY_ADDRESS'), ray.get_runtime_context().gcs_address, "
    "ray.get(ray.remote(lambda: 1).remote()))"
)


def test_a_run_joins_the_sessions_cluster_and_one_that_asks_starts_its_own():
    shared = join_env()["RAY_ADDRESS"]
    joined = run_command([sys.executable, "-c", DRIVER], timeout=120)
    assert joined.returncode == 0, tail(joined)
    assert joined.stdout.split() == [shared, shared, "1"], tail(joined)
    # With token authentication, as on the local cluster a run starts itself (vlmrl.driver.cluster_auth: no
    # warning about a cluster without it).
    assert join_env()["RAY_AUTH_MODE"] == "token"

    own = run_command([sys.executable, "-c", DRIVER], timeout=120, own_cluster=True)
    assert own.returncode == 0, tail(own)
    address_env, address, _ = own.stdout.split()
    assert address_env == "None" and address != shared, tail(own)


def test_pytest_itself_names_no_cluster():
    join_env()
    assert "RAY_ADDRESS" not in os.environ


# A driver in another directory than the cluster's (the session's cluster was started from the repository), with
# the job settings a run gives its workers: where do they read relative paths from?
IN_ANOTHER_DIR = (
    "import os, ray; from vlmrl.driver.console import runtime_env; "
    "ray.init(logging_level='ERROR', runtime_env=runtime_env(os.devnull, False)); "
    "print(ray.get(ray.remote(lambda: os.getcwd()).remote()))"
)


def test_a_run_that_joins_a_cluster_started_elsewhere_reads_relative_paths_from_its_own_directory(tmp_path):
    proc = run_command([sys.executable, "-c", IN_ANOTHER_DIR], timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, tail(proc)
    assert proc.stdout.split()[-1] == str(tmp_path), tail(proc)
