"""Two FSDP workers on a simulated multi-node Ray cluster: they compute what one process computes, and train.

One ``ray.cluster_utils.Cluster`` (three one-CPU nodes, each with its own
raylet, on this machine) and one worker group of ``trainer.nnodes=2`` x
``n_gpus_per_node=1`` serve both tests, so the cost of starting workers is paid
once: a placement group per node, a TCP rendezvous, gloo between the workers,
padding-free passes and token-budget micro-batches. The single-process
reference and the training run are shared with tests/test_one_node_workers.py
(tests/helpers/multi_worker.py).
"""

from __future__ import annotations

import pytest
from helpers.multi_worker import check_workers_match_one_process, train
from helpers.runs import SMALL
from helpers.shared_cluster import forked_runtime_env

from vlmrl.validate import load_config
from vlmrl.plan import detect_cluster, resolve

STEPS = 2


@pytest.fixture(scope="module")
def two_nodes(tiny_assets, tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from vlmrl.driver.scoring import start_scorers
    from vlmrl.workers.group import WorkerGroup

    if ray.is_initialized():
        ray.shutdown()
    # Three nodes of one CPU: two worker bundles and the reward actor, so the workers land on different nodes.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env=forked_runtime_env())
    tmp = tmp_path_factory.mktemp("two_nodes")
    base = [
        "config=examples/quickstart.yaml",
        f"trainer.output_dir={tmp / 'outputs'}",
        *SMALL,
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "worker.actor.padding_free=true",
        "worker.actor.dynamic_batching=true",
        "algorithm.disable_kl=false",
        "trainer.save_hf_weights=false",
        "trainer.logger=[file]",
    ]
    config = load_config(base)
    longest = config.data.max_prompt_length + config.data.max_response_length
    base += [  # a budget of one full sequence: the two short samples of a worker may share a pass
        f"worker.actor.max_token_len_per_device_for_update={longest}",
        f"worker.actor.max_token_len_per_device_for_experience={longest}",
    ]
    config = load_config(base)
    plan = resolve(config, detect_cluster())
    assert (plan.nnodes, plan.world_size) == (2, 2)
    workers = WorkerGroup(config, plan)
    assert len(set(workers.pool.nodes())) == 2, workers.pool.nodes()
    scorers = start_scorers(config.worker.reward, validation=False)
    yield {"base": base, "config": config, "plan": plan, "workers": workers, "scorers": scorers}
    workers.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_two_workers_compute_what_one_process_computes(two_nodes):
    remote_metrics = check_workers_match_one_process(two_nodes["config"], two_nodes["plan"], two_nodes["workers"])
    # Balance metrics: contiguous halves vs balanced halves of the 4 sequences.
    assert remote_metrics["global_seqlen/balanced_max"] <= remote_metrics["global_seqlen/max"]
    assert remote_metrics["actor/padding_share"] == 0  # padding-free
    assert remote_metrics["perf/cpu_memory_peak_gb"] > 0


def test_two_node_cluster_trains(two_nodes):
    # Runs after the equivalence test: the workers' weights have moved one step; that does not matter here.
    metrics = train(two_nodes["base"], two_nodes["workers"], two_nodes["scorers"], "two_nodes", STEPS)
    for m in metrics:
        for key in ("actor/pg_loss", "actor/kl_loss", "global_seqlen/balanced_max", "actor/padding_share"):
            assert key in m, (m["step"], key)
        assert m["global_seqlen/balanced_max"] <= m["global_seqlen/max"]
