"""Fault: one node's worth of workers placed on another node of a larger Ray cluster than the Runner's.

The file rendezvous puts its store in a temporary directory on the Runner's own
disk; workers on another node never see it and wait for each other forever.
It must be used only when the workers share the Runner's node; otherwise the
TCP store on rank 0's node.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # The head (where this process, standing in for the Runner, runs) has no CPU for a worker bundle.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield
    ray.shutdown()
    cluster.shutdown()


def test_workers_on_another_node_meet_over_tcp_not_a_local_file(two_node_cluster):
    import ray

    from vlmrl.workers.group import ResourcePool

    pool = ResourcePool(nnodes=1, per_node=1, device="cpu", run_name="faults")
    try:
        assert pool.nodes()[0] != ray.get_runtime_context().get_node_id()
        init_method, _env = pool.rendezvous()
        assert init_method.startswith("tcp://"), init_method
        assert pool.scratch is None  # no local directory the workers could not see
    finally:
        pool.release()


def test_workers_on_this_node_keep_the_file_rendezvous():
    import ray

    from vlmrl.workers.group import ResourcePool

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        pool = ResourcePool(nnodes=1, per_node=1, device="cpu", run_name="faults")
        try:
            init_method, env = pool.rendezvous()
            assert init_method.startswith("file://") and env == {"GLOO_SOCKET_IFNAME": "lo"}
        finally:
            pool.release()
    finally:
        ray.shutdown()
