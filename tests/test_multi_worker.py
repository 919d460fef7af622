"""Two FSDP workers on a simulated multi-node Ray cluster: they compute what one process computes, and train.

One ``ray.cluster_utils.Cluster`` (three one-CPU nodes, each with its own
raylet, on this machine) and one worker group of ``trainer.nnodes=2`` x
``n_gpus_per_node=1`` serve both tests, so the cost of starting workers is paid
once: a placement group per node, a TCP rendezvous, gloo between the workers,
padding-free passes and token-budget micro-batches.

The single-process reference is the plain HF model with the same AdamW: what
one worker computes (FSDP over one rank is the same arithmetic). Adam's first
step is nearly sign(gradient) x lr, blind to a wrong gradient scale, so the
gradient norm the workers report is compared too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers.runs import SMALL
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.config import load_config
from vlmrl.data.loader import make_loader
from vlmrl.plan import detect_cluster, resolve
from vlmrl.trainer.checkpoint import CheckpointManager
from vlmrl.trainer.core_algos import LossAvgMode
from vlmrl.trainer.ray_trainer import RayPPOTrainer
from vlmrl.trainer.runner import _dataset
from vlmrl.trainer.tracking import LoggerName, RunInfo, Tracker
from vlmrl.workers.actor import MicroBatching, UpdateSettings, compute_log_probs, update_policy
from vlmrl.workers.batching import build_batch
from vlmrl.workers.rollout import Generation, sampling_mask

STEPS = 2


@pytest.fixture(scope="module")
def two_nodes(tiny_assets, tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from vlmrl.trainer.scoring import start_scorers
    from vlmrl.workers.worker_group import WorkerGroup

    if ray.is_initialized():
        ray.shutdown()
    # Three nodes of one CPU: two worker bundles and the reward actor, so the workers land on different nodes.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
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


def fixed_batch(config, model, processor):
    """4 samples: 2 image prompts x 2 responses of ragged lengths, with old/ref log-probs and advantages to fill."""
    dataset = _dataset(config, config.data.train_files, processor)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    generations = []
    for i, length in enumerate([8, 2, 5, 3]):
        ids = allowed_ids[torch.randint(len(allowed_ids), (length,), generator=gen)].tolist()
        generations.append(Generation(dataset[i // 2], i // 2, ids, "", None))
    batch = build_batch(
        generations,
        max_prompt_length=config.data.max_prompt_length,
        max_response_length=config.data.max_response_length,
        pad_token_id=processor.tokenizer.pad_token_id,
        model=model,
    )
    return batch, allowed, gen


def test_two_workers_compute_what_one_process_computes(two_nodes):
    config, plan, workers = two_nodes["config"], two_nodes["plan"], two_nodes["workers"]
    model_dir = config.worker.actor.model.model_path
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    batch, allowed, gen = fixed_batch(config, model, processor)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # Log-probs: the balanced shards come back in the batch's order.
    mask = batch.response_mask.bool()
    local, _ = compute_log_probs(model, batch, MicroBatching(len(batch)), 1.0, allowed)
    remote, _ = workers.compute_old_log_probs(batch)
    torch.testing.assert_close(remote[mask], local[mask], rtol=0, atol=1e-5)

    batch.old_log_probs = local + 0.2 * torch.randn(local.shape, generator=gen)
    batch.ref_log_probs = local + 0.2 * torch.randn(local.shape, generator=gen)
    batch.advantages = torch.randn(len(batch), 1, generator=gen).expand_as(local) * batch.response_mask
    # Sequence-mean losses, one micro-batch per worker: the mean of the workers' losses is the global loss.
    settings = UpdateSettings.from_config(config, plan)
    settings = dataclasses.replace(
        settings,
        micro_batch_size=len(batch) // plan.world_size,
        max_token_len=None,
        loss_params=dataclasses.replace(settings.loss_params, loss_avg_mode=LossAvgMode.seq_mean_token_mean),
    )
    remote_metrics = workers.update_actor(batch, settings)
    optim = config.worker.actor.optim
    adamw = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )
    local_settings = dataclasses.replace(settings, samples_per_update=len(batch), micro_batch_size=len(batch))
    local_metrics = update_policy(model, adamw, batch, local_settings, allowed)

    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert remote_metrics[key] == pytest.approx(local_metrics[key], rel=1e-4, abs=1e-6), key
    weights = workers.full_weights()
    assert weights.keys() == model.state_dict().keys()
    moved = max(float((model.state_dict()[k] - before[k]).abs().max()) for k in before)
    assert moved > 0.5 * optim.lr  # the step really changed the weights
    # Adam divides by |gradient| + eps, so where a gradient is within a few eps of zero, its last-bit
    # differences (a different reduction order over two ranks) move that one weight's step by a share of lr.
    # Elementwise, then, within a tenth of lr; as a whole, the two updates agree to 1e-3 of their size.
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0.1 * optim.lr, msg=lambda m, n=name: f"{n}: {m}")
    local_step = torch.cat([(model.state_dict()[k] - before[k]).flatten() for k in before])
    remote_step = torch.cat([(weights[k] - before[k]).flatten() for k in before])
    assert float((remote_step - local_step).norm()) < 1e-3 * float(local_step.norm())
    # Balance metrics: contiguous halves vs balanced halves of the 4 sequences.
    assert remote_metrics["global_seqlen/balanced_max"] <= remote_metrics["global_seqlen/max"]
    assert remote_metrics["actor/padding_share"] == 0  # padding-free
    assert remote_metrics["perf/cpu_memory_peak_gb"] > 0


def test_two_node_cluster_trains(two_nodes):
    # Runs after the equivalence test: the workers' weights have moved one step; that does not matter here.
    config, workers = two_nodes["config"], two_nodes["workers"]
    config = load_config([*two_nodes["base"], "trainer.experiment_name=two_nodes", f"trainer.max_steps={STEPS}"])
    plan = resolve(config, detect_cluster())
    processor = AutoProcessor.from_pretrained(config.worker.actor.model.model_path)
    dataset = _dataset(config, config.data.train_files, processor)
    loader = make_loader(dataset, config.data.rollout_batch_size, True, config.data.seed, drop_last=True)
    run = RunInfo(config.trainer.project_name, "two_nodes", plan.experiment_dir, {}, plan.as_dict())
    tracker = Tracker([LoggerName.file], run)
    checkpoints = CheckpointManager(plan.checkpoint_dir, 1)
    RayPPOTrainer(config, plan, loader, None, two_nodes["scorers"], workers, tracker, checkpoints).fit()
    metrics = [json.loads(line) for line in (Path(plan.experiment_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (m["step"], bad)
        for key in ("actor/pg_loss", "actor/kl_loss", "global_seqlen/balanced_max", "actor/padding_share"):
            assert key in m, (m["step"], key)
        assert m["global_seqlen/balanced_max"] <= m["global_seqlen/max"]
