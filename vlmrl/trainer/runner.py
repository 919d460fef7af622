"""The Runner: a Ray actor that builds the run's pieces and starts the trainer.

Building here rather than in the driver script keeps the driver process light
and makes the same code path serve a local cluster and a remote one.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray
from transformers import AutoProcessor

from vlmrl.config import Config, to_dict
from vlmrl.data.dataset import RLHFDataset
from vlmrl.data.loader import make_loader
from vlmrl.plan import Plan
from vlmrl.reward.manager import manager_class
from vlmrl.trainer.ray_trainer import RayPPOTrainer
from vlmrl.trainer.tracking import Tracker
from vlmrl.workers.worker_group import WorkerGroup


def _dataset(config: Config, files: str, processor) -> RLHFDataset:
    data = config.data
    return RLHFDataset(
        files,
        processor,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        image_key=data.image_key,
        image_dir=data.image_dir,
        max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels,
        max_pixels=data.max_pixels,
        format_prompt=data.format_prompt,
        override_chat_template=data.override_chat_template,
        filter_overlong_prompts=data.filter_overlong_prompts,
    )


class Runner:
    def run(self, config: Config, plan: Plan) -> None:
        experiment_dir = Path(plan.experiment_dir)
        experiment_dir.mkdir(parents=True, exist_ok=True)
        (experiment_dir / "config.json").write_text(json.dumps({"config": to_dict(config), "plan": plan.as_dict()}, indent=2))
        print(f"plan: {json.dumps(plan.as_dict())}", flush=True)

        model = config.worker.actor.model
        processor = AutoProcessor.from_pretrained(model.tokenizer_path or model.model_path)
        data = config.data
        train = _dataset(config, data.train_files, processor)
        train_loader = make_loader(train, data.rollout_batch_size, data.shuffle, data.seed, drop_last=True)
        val_loader = None
        if data.val_files:
            val = _dataset(config, data.val_files, processor)
            val_batch = len(val) if data.val_batch_size == -1 else data.val_batch_size
            val_loader = make_loader(val, val_batch, shuffle=False, seed=data.seed, drop_last=False)

        reward = config.worker.reward
        manager = ray.remote(manager_class(reward.reward_function, reward.reward_type))
        reward_manager = manager.options(num_cpus=reward.num_cpus).remote(
            reward.reward_function, reward.reward_function_kwargs
        )
        workers = WorkerGroup(config, plan)
        tracker = Tracker(config.trainer.logger, plan.experiment_dir)
        RayPPOTrainer(config, plan, train_loader, val_loader, reward_manager, workers, tracker).fit()
