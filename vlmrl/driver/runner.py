"""The Runner: a Ray actor that builds the run's pieces and starts the trainer.

Building here rather than in the driver script keeps the driver process light
and makes the same code path serve a local cluster and a remote one.

Start-up is most of a short run, so the pieces start side by side: the driver
creates the worker actors as soon as it has joined Ray (each imports torch,
transformers and vLLM and loads its models) and this process starts beside
them, reads the data and starts the reward actors while the workers are still
loading. A run that resumes has its workers created here, after the checks of
its checkpoint. The Runner's own lines reach the user's terminal through
``take_console`` (``vlmrl.driver.console``).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrl import workflows
from vlmrl.config import Config, RewardModelPlacement, to_dict
from vlmrl.config.redact import mask_text, mask_values
from vlmrl.driver.console import ConsoleFeed, Progress
from vlmrl.heap import started
from vlmrl.plan import Plan, describe

# The rest (the step loop, the worker group, the data: torch, transformers and the image processors, about
# 8 s of CPU) is imported inside ``run``: the driver process imports this module only to name the actor
# class, and should not pay for what only the actor uses.
if TYPE_CHECKING:
    from vlmrl.data.dataset import RLHFDataset
    from vlmrl.driver.hooks import RunHooks
    from vlmrl.workers.group import StartedWorkers


def _dataset(config: Config, files: str, processor) -> RLHFDataset:
    from vlmrl.data.dataset import RLHFDataset  # datasets and transformers: imported while the workers start

    data = config.data
    model = config.worker.actor.model
    model_config = None
    if model.tokenizer_path:  # the positions and the model kind come from the model's config, not the tokenizer's dir
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(model.model_path, trust_remote_code=model.trust_remote_code)
    return RLHFDataset(
        files,
        processor,
        model_config=model_config,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        image_key=data.image_key,
        image_dir=data.image_dir,
        allow_paths_outside_image_dir=data.allow_paths_outside_image_dir,
        max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels,
        max_pixels=data.max_pixels,
        format_prompt=data.format_prompt,
        override_chat_template=data.override_chat_template,
        filter_overlong_prompts=data.filter_overlong_prompts,
        filter_overlong_prompts_workers=data.filter_overlong_prompts_workers,
        video_key=data.video_key,
        video_fps=data.video_fps,
        on_bad_sample=data.on_bad_sample,
        limit_images=config.worker.rollout.limit_images,
        tools=tool_schemas(config),
    )


def tool_schemas(config: Config) -> list[dict]:
    """The function schemas every prompt shows (tools configured for a kind that calls them: multi_turn or a
    workflow class), in the order of the tools key."""
    multi_turn = config.worker.rollout.multi_turn
    if not multi_turn.tools or workflows.workflow_name(config.worker.rollout) in ("single_turn", "openai_agent"):
        return []
    from vlmrl.rollout.turns.tools import load_tools

    return [t.schema() for t in load_tools(multi_turn.tools)]


class Runner:
    """Runs with two threads: ``run`` drives training, ``request_stop`` can arrive meanwhile."""

    def __init__(self):
        self.stop_requested = threading.Event()
        self.console = ConsoleFeed.install()

    def take_console(self) -> tuple[list[str], Progress | None]:
        """The lines printed since the last call, and the step loop's progress (the driver shows them)."""
        return self.console.take()

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint, and return from ``run``."""
        self.stop_requested.set()

    def run(
        self, config: Config, plan: Plan, hooks: RunHooks | None = None, prestarted: StartedWorkers | None = None
    ) -> None:
        """Train to the end. ``prestarted``: the workers the driver has already created (``start_workers``);
        without them they are created here."""
        from vlmrl.driver.checkpoint import CheckpointManager, load_trainer_state
        from vlmrl.driver.resume import check_resume
        from vlmrl.driver.reward_model import reward_model_link, start_reward_model
        from vlmrl.driver.scoring import start_scorers
        from vlmrl.workers.group import WorkerGroup

        experiment_dir = Path(plan.experiment_dir)
        experiment_dir.mkdir(parents=True, exist_ok=True)
        # Secrets (vlmrl.config.redact) as ***: to_dict masks the config's, mask_values and mask_text the plan's.
        (experiment_dir / "config.json").write_text(
            json.dumps({"config": to_dict(config), "plan": mask_values(plan.as_dict())}, indent=2)
        )
        print("plan:\n  " + mask_text(describe(plan, config)).replace("\n", "\n  "), flush=True)

        trainer_cfg = config.trainer
        checkpoints = CheckpointManager(plan.checkpoint_dir, trainer_cfg.save_limit)
        checkpoints.remove_stale_temporaries()  # the driver holds the run lock (vlmrl.driver.run_lock)
        resume_from = checkpoints.resume_path(trainer_cfg.load_checkpoint_path, trainer_cfg.find_last_checkpoint)
        if resume_from is not None:  # before any worker loads a model
            check_resume(resume_from, config, explicit=bool(trainer_cfg.load_checkpoint_path))

        loaders = None
        if resume_from is not None and not trainer_cfg.val_only:
            # Is there training left? Known from the data and the checkpoint, before any worker starts.
            loaders = self._loaders(config)
            finished = _finished_line(load_trainer_state(resume_from)["global_step"], len(loaders[0]), config)
            if finished:
                print(finished, flush=True)
                return
        # The workers start (a minute or more; the driver's are already starting) while this process imports the
        # step loop, reads the data and starts the reward actors. What the starting thread imports is imported
        # here first, as transformers' lazy imports are not safe from two threads: the workers' class (which
        # leaves its roles' imports to the worker processes, so this is quick) and, disaggregated, the rollout
        # servers' module.
        import vlmrl.workers.hybrid  # noqa: F401

        if plan.rollout_servers:
            import vlmrl.workers.rollout_pool  # noqa: F401

        background = ThreadPoolExecutor(1, thread_name_prefix="vlmrl-start")
        starting = background.submit(WorkerGroup, config, plan, prestarted)
        background.shutdown(wait=False)
        tracker = None
        try:
            from vlmrl.driver.loop import TrainingLoop  # transformers, scipy: seconds, beside the workers

            judge = start_reward_model(config, plan)  # a separate reward model loads beside the workers
            train_loader, val_loader = loaders or self._loaders(config)
            reward, validation = config.worker.reward, val_loader is not None
            timeout = config.trainer.start_timeout_s
            if reward.reward_model.model_path and reward.reward_model.placement is RewardModelPlacement.colocated:
                tracker = _tracker(config, plan, resume_from)  # while the workers load
                workers = starting.result()  # they hold the reward model
                scorers = start_scorers(
                    reward, validation, reward_model_link(config, None, workers.workers), timeout, plan.reward_workers
                )
            else:
                # A reward function that cannot start fails the run before the workers are up.
                scorers = start_scorers(
                    reward, validation, reward_model_link(config, judge, None), timeout, plan.reward_workers
                )
                tracker = _tracker(config, plan, resume_from)  # while the workers load
                workers = starting.result()
        except BaseException:
            if tracker is not None:  # the workers did not come up: the MLflow run is marked FAILED
                tracker.close(failed=True)
            # The run stops here; the group, once up, has nothing to rendezvous for.
            starting.add_done_callback(lambda f: f.exception() is None and f.result().pool.remove_scratch())
            raise
        started()  # the loaders, the handles and the libraries live as long as the run (vlmrl.heap)
        tracker.start_clock()  # the run summary's time is the training's, not the workers' start
        try:
            TrainingLoop(
                config, plan, train_loader, val_loader, scorers, workers, tracker,
                checkpoints=checkpoints, resume_from=resume_from, stop_requested=self.stop_requested, hooks=hooks,
            ).fit()  # fmt: skip
            if trainer_cfg.ray_timeline:  # EasyR1's key: Ray's task timeline, for chrome://tracing
                import ray

                ray.timeline(filename=trainer_cfg.ray_timeline)
                print(f"ray timeline: {trainer_cfg.ray_timeline}", flush=True)
        except BaseException:
            tracker.close(failed=True)  # the MLflow run is marked FAILED rather than left RUNNING
            raise
        finally:
            workers.pool.remove_scratch()  # the vlmrl-rendezvous-<experiment>-* temp dir

    @staticmethod
    def _loaders(config: Config):
        """The training loader and the validation loader (or None), with a line saying what they hold."""
        from vlmrl.data.loader import make_loader
        from vlmrl.train.models import load_processor

        model, data = config.worker.actor.model, config.data
        processor = load_processor(model.model_path, model.tokenizer_path, model.trust_remote_code, announce=True)
        train = _dataset(config, data.train_files, processor)
        train_loader = make_loader(train, data.rollout_batch_size, data.shuffle, data.seed, drop_last=True)
        per_epoch = f"{len(train_loader)} steps per epoch of {data.rollout_batch_size}"
        summary = f"data: {len(train)} training prompts, {per_epoch}"
        val_loader = None
        if data.val_files:
            val = _dataset(config, data.val_files, processor)
            val_batch = len(val) if data.val_batch_size == -1 else data.val_batch_size
            val_loader = make_loader(val, val_batch, shuffle=False, seed=data.seed, drop_last=False)
            summary += f"; {len(val)} validation prompts"
        print(summary, flush=True)
        return train_loader, val_loader


def _tracker(config: Config, plan: Plan, resume_from: Path | None):
    """The run's loggers, built while the workers start: MLflow's import and a new store's tables take seconds.

    A run resumed from its own checkpoint continues its logger runs (the same MLflow run id); one started from
    another experiment's checkpoint gets runs of its own.
    """
    from vlmrl.driver.checkpoint import load_trainer_state
    from vlmrl.loggers.tracking import RunInfo, Tracker

    trainer_cfg = config.trainer
    saved = load_trainer_state(resume_from) if resume_from is not None else {}
    # A training run re-logs the steps past its checkpoint: the file logger drops an earlier attempt's lines of them.
    resumed_step = None if trainer_cfg.val_only else saved.get("global_step")
    run = RunInfo(
        trainer_cfg.project_name, trainer_cfg.experiment_name, plan.experiment_dir, to_dict(config),
        mask_values(plan.as_dict()),
        resumed_step=resumed_step,
    )  # fmt: skip
    own_checkpoint = resume_from is not None and resume_from.resolve().parent == Path(plan.checkpoint_dir)
    tracker_state = saved.get("tracker") if own_checkpoint else None
    return Tracker(trainer_cfg.logger, run, resume_state=tracker_state)


def _finished_line(done: int, steps_per_epoch: int, config: Config) -> str | None:
    """The one line for a run whose checkpoint already holds all its steps, or None when there is training left."""
    from vlmrl.driver.loop import planned_steps

    trainer_cfg = config.trainer
    total = planned_steps(steps_per_epoch, trainer_cfg.total_epochs, trainer_cfg.max_steps)
    if done < total:
        return None
    if trainer_cfg.max_steps and trainer_cfg.max_steps == total:
        limit = f"max_steps={trainer_cfg.max_steps}"
    else:
        limit = f"the {total} steps of total_epochs={trainer_cfg.total_epochs}"
    where = "past" if done > total else "at"
    return (
        f"nothing to train: the checkpoint at step {done} is {where} {limit}; "
        f"remove it or pick another experiment_name (or raise trainer.max_steps to train further)"
    )
