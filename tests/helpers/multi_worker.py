"""What several FSDP workers must reproduce of one process, and a short training run, for the multi-worker tests.

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
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import multi_turn
from vlmrl.records import Trajectory
from vlmrl.records.views import to_batch
from vlmrl.validate import load_config
from vlmrl.data.loader import make_loader
from vlmrl.plan import detect_cluster, resolve
from vlmrl.driver.checkpoint import CheckpointManager
from vlmrl.algos import LossAvgMode
from vlmrl.driver.loop import TrainingLoop
from vlmrl.driver.runner import _dataset
from vlmrl.config import LoggerName
from vlmrl.loggers.tracking import RunInfo, Tracker
from vlmrl.train.actor import UpdateSettings, compute_log_probs, update_policy
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS


def fixed_batch(config, model, processor):
    """4 samples: 2 image prompts x 2 responses of ragged lengths, with old/ref log-probs and advantages to fill.

    Two of the four are conversations (a model turn, an observation the model did not write, another turn),
    so that the workers must also reproduce one process on multi-turn rows: loss-mask gaps inside a row.
    """
    dataset = _dataset(config, config.data.train_files, processor)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return allowed_ids[torch.randint(len(allowed_ids), (n,), generator=gen)].tolist()

    trajectories = [
        multi_turn(dataset[0], 0, 0, [(tokens(3), 1), (tokens(3), 0), (tokens(2), 1)]),
        Trajectory.single_turn(dataset[0], 0, 1, tokens(2), "", 1.0),
        multi_turn(dataset[1], 1, 0, [(tokens(2), 1), (tokens(2), 0), (tokens(1), 1)]),
        Trajectory.single_turn(dataset[1], 1, 1, tokens(3), "", 1.0),
    ]
    # The engine's log-probs travel on the trajectories (a worker rebuilds its rows from them), for a config whose
    # plan runs a rollout correction (calculate_log_probs=true turns truncation on) or the decoupled loss.
    trajectories = [
        dataclasses.replace(t, log_probs=(-3.0 * torch.rand(len(t.token_ids), generator=gen)).tolist())
        for t in trajectories
    ]
    batch = to_batch(
        trajectories,
        max_prompt_length=config.data.max_prompt_length,
        max_response_length=config.data.max_response_length,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    return batch, allowed, gen


def check_workers_match_one_process(config, plan, workers) -> dict[str, float]:
    """Log-probs, one update's losses and grad norm, and the updated weights: workers == one process.

    Returns the workers' update metrics. The workers' weights move one step.
    """
    model_dir = config.worker.actor.model.model_path
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    batch, allowed, gen = fixed_batch(config, model, processor)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # Log-probs: the balanced shards come back in the batch's order.
    mask = batch.response_mask.bool()
    local, _ = compute_log_probs(model, batch, MicroBatching(len(batch)), allowed)
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
    remote_metrics = workers.update_actor(batch, settings, old_from_forward=False).metrics
    optim = config.worker.actor.optim
    adamw = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )
    local_settings = dataclasses.replace(settings, samples_per_update=len(batch), micro_batch_size=len(batch))
    local_metrics = update_policy(model, adamw, batch, local_settings, allowed).metrics

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
    return remote_metrics


def train(base: list[str], workers, scorers, name: str, steps: int) -> list[dict]:
    """``steps`` training steps of the config ``base`` on ``workers``; the metrics lines, checked finite."""
    config = load_config([*base, f"trainer.experiment_name={name}", f"trainer.max_steps={steps}"])
    plan = resolve(config, detect_cluster())
    processor = AutoProcessor.from_pretrained(config.worker.actor.model.model_path)
    dataset = _dataset(config, config.data.train_files, processor)
    loader = make_loader(dataset, config.data.rollout_batch_size, True, config.data.seed, drop_last=True)
    run = RunInfo(config.trainer.project_name, name, plan.experiment_dir, {}, plan.as_dict())
    tracker = Tracker([LoggerName.file], run)
    checkpoints = CheckpointManager(plan.checkpoint_dir, 1)
    TrainingLoop(config, plan, loader, None, scorers, workers, tracker, checkpoints).fit()
    metrics = [json.loads(line) for line in (Path(plan.experiment_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (m["step"], bad)
    return metrics
