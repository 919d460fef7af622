"""Two FSDP workers on one node (local Ray, ``trainer.nnodes=1``, ``n_gpus_per_node=2``) do what one process does.

One worker group serves the module: a placement group of two bundles on one
node, the file rendezvous, gloo between the workers, the padded passes (the
simulated multi-node test, tests/test_multi_worker.py, runs padding-free), and
1 MB resync buckets so that every resync streams the tiny model in several
all-gathers.

- The workers' log-probs, one update's losses, grad norm and updated weights
  equal a single process's (tests/helpers/multi_worker.py, shared with the
  multi-node test).
- The resync after that update reports its metrics, the slowest worker's.
- Two training steps: the per-step resync, throughput and peak memory metrics
  are logged, and vLLM samples from the resynced weights in step 2 (its
  log-probs of its own samples match the actor's).
"""

from __future__ import annotations

import pytest
from helpers.multi_worker import check_workers_match_one_process, train
from helpers.runs import SMALL
from helpers.shared_cluster import forked_runtime_env

from vlmrl.validate import load_config
from vlmrl.plan import detect_cluster, resolve

BUCKET_MB = 1


@pytest.fixture(scope="module")
def one_node(tiny_assets, tmp_path_factory):
    import ray

    from vlmrl.driver.scoring import start_scorers
    from vlmrl.workers.group import WorkerGroup

    if ray.is_initialized():
        ray.shutdown()
    # Two worker bundles and the reward actor: logical CPUs, the workers take turns on the cores.
    ray.init(address="local", num_cpus=3, include_dashboard=False, runtime_env=forked_runtime_env())
    tmp = tmp_path_factory.mktemp("one_node")
    base = [
        "config=examples/quickstart.yaml",
        f"trainer.output_dir={tmp / 'outputs'}",
        *SMALL,
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=2",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "algorithm.disable_kl=false",
        f"worker.rollout.resync_bucket_mb={BUCKET_MB}",
        "trainer.save_hf_weights=false",
        "trainer.logger=[file]",
        "worker.rollout.calculate_log_probs=true",  # vLLM's log-probs, for the mismatch check after a resync
    ]
    config = load_config(base)
    plan = resolve(config, detect_cluster())
    assert (plan.nnodes, plan.world_size) == (1, 2)
    workers = WorkerGroup(config, plan)
    assert len(set(workers.pool.nodes())) == 1
    scorers = start_scorers(config.worker.reward, validation=False)
    yield {"base": base, "config": config, "plan": plan, "workers": workers, "scorers": scorers}
    workers.shutdown()
    ray.shutdown()


def test_two_workers_on_one_node_compute_what_one_process_computes(one_node):
    metrics = check_workers_match_one_process(one_node["config"], one_node["plan"], one_node["workers"])
    assert metrics["perf/cpu_memory_peak_gb"] > 0
    assert metrics["actor/padding_share"] > 0  # the padded passes


def test_resync_after_the_update_streams_in_buckets(one_node):
    metrics = one_node["workers"].sync_weights()
    assert metrics["timing_s/resync_worker"] > 0
    # All-gathers of at most one bucket (or one larger tensor: the tiny model has none over 1 MB).
    assert 0 < metrics["perf/resync_bucket_peak_mb"] <= BUCKET_MB + 0.01


def test_two_workers_on_one_node_train(one_node):
    steps = train(one_node["base"], one_node["workers"], one_node["scorers"], "one_node", 2)
    for m in steps:
        for key in (
            "timing_s/update_weights", "timing_s/resync_worker", "perf/resync_bucket_peak_mb",
            "perf/tokens_per_second_per_device", "perf/cpu_memory_peak_gb", "global_seqlen/balanced_max",
        ):  # fmt: skip
            assert key in m, (m["step"], key)
        assert m["perf/tokens_per_second_per_device"] == pytest.approx(m["perf/throughput"])
        assert m["timing_s/resync_worker"] <= m["timing_s/update_weights"]
    # Step 2 sampled from the weights step 1's resync streamed in: vLLM's log-probs of its own samples are the
    # actor's (a wrong or stale resync moves them by far more; fp32 image prompts differ by ~2e-3 at most).
    assert steps[1]["rollout/log_prob_diff_max"] < 1e-2, steps[1]
