"""The driver loop: one ``fit`` that reads as the dataflow of a step."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from vlmrl.config import Config, to_dict
from vlmrl.config.redact import mask_values
from vlmrl.plan import Plan
from vlmrl.records import PromptSample
from vlmrl.rng import rng_state, set_rng_state
from vlmrl.driver.advantage import AdvantageStage
from vlmrl.driver.async_sampler import AsyncRolloutSampler
from vlmrl.driver.hooks import RunHooks
from vlmrl.driver.generations import write_generations
from vlmrl.driver.checkpoint import CheckpointManager, load_trainer_state, save_trainer_state, verify_shards
from vlmrl.driver.resume import fingerprint
from vlmrl.driver.save_schedule import SaveSchedule
from vlmrl.driver.user_files import user_files
from vlmrl.driver.stall import SkippedStepWatch, optimizer_steps
from vlmrl.driver.metrics import batch_metrics
from vlmrl.driver.mismatch import mismatch_metrics
from vlmrl.driver.perf import PerfMeter, ProgressBar
from vlmrl.driver.sampler import RolloutSampler, Sampler
from vlmrl.driver.signal_check import SignalCheck
from vlmrl.driver.scoring import Scorers
from vlmrl.loggers.tracking import Tracker
from vlmrl.driver.validation import Validator
from vlmrl.train.actor import UpdateSettings
from vlmrl.train.critic import CriticSettings
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.kind import Credit
from vlmrl import workflows
from vlmrl.workers.group import WorkerGroup


def planned_steps(steps_per_epoch: int, total_epochs: int, max_steps: int | None) -> int:
    """The run's steps: its epochs' worth, cut at ``max_steps`` when that is set."""
    total = steps_per_epoch * total_epochs
    return min(total, max_steps) if max_steps else total


@contextmanager
def timer(name: str, timings: dict[str, float]):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


class TrainingLoop:
    """The step loop of every algorithm: rollout, rewards, log-probs, advantages, updates, resync, save."""

    def __init__(
        self,
        config: Config,
        plan: Plan,
        train_loader,
        val_loader,
        scorers: Scorers,
        workers: WorkerGroup,
        tracker: Tracker,
        checkpoints: CheckpointManager,
        resume_from: Path | None = None,
        stop_requested: threading.Event | None = None,
        hooks: RunHooks | None = None,
    ):
        self.config, self.plan = config, plan
        self.train_loader = train_loader
        self.steps_per_epoch = len(train_loader)
        self.checkpoints = checkpoints
        self.resume_from = resume_from
        self.stop_requested = stop_requested or threading.Event()
        self.hooks = hooks or RunHooks()
        self.scorer = scorers.train
        self.workers = workers
        self.tracker = tracker
        self.next_group_id = 0
        self.prompt_batches_used = 0
        """Training prompt batches drawn so far; more than the steps when online filtering draws extra ones."""
        self.prompt_stream = None
        rollout = config.worker.rollout
        self.train_sampling = Sampling(
            n=rollout.n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_tokens=config.data.max_response_length,
            want_log_probs=plan.rollout_log_probs,
            ignore_eos=rollout.ignore_eos,
        )
        self.validator = None
        if val_loader is not None:
            val_sampling = dataclasses.replace(
                self.train_sampling,
                n=plan.val_n,
                temperature=plan.val_temperature,
                top_p=plan.val_top_p,
                top_k=plan.val_top_k,
                ignore_eos=False,
            )
            self.validator = Validator(
                workers,
                scorers.val,
                val_loader,
                val_sampling,
                plan.experiment_dir,
                config.trainer.val_generations_to_log,
                tracker=tracker,
            )
        # The rollout kind, chosen once: whether a rollout may span rows (advantages per rollout), and whether a
        # prompt's rows vary (then the sampler computes the advantages and trims the rows to mini-batches).
        self.kind = workflows.properties(config)
        self.advantages = AdvantageStage(
            config.algorithm, plan.kl_in_reward, per_rollout=self.kind.credit is Credit.per_rollout,
            distills=plan.use_teacher,
        )
        self.sampler: Sampler
        if rollout.async_rl.enable:  # groups admitted ahead under a staleness bound, scored while the trainer trains
            self.sampler = AsyncRolloutSampler(
                config, workers, self.scorer, self.train_sampling, self._group_ids, train_loader.dataset.sample,
                self.advantages, plan.samples_per_update, variable_rows=self.kind.variable_rows,
            )  # fmt: skip
        else:
            self.sampler = RolloutSampler(
                config, workers, self.scorer, self.train_sampling, self._group_ids, self.advantages,
                plan.samples_per_update, variable_rows=self.kind.variable_rows,
            )  # fmt: skip
        self.total_steps = planned_steps(self.steps_per_epoch, config.trainer.total_epochs, config.trainer.max_steps)
        # The learning-rate schedules span the run's training steps (EasyR1's optim.training_steps).
        self.actor_settings = UpdateSettings.from_config(config, plan, self.total_steps)
        self.critic_settings = CriticSettings.from_config(config, plan, self.total_steps) if plan.use_critic else None
        self.perf = PerfMeter.for_run(config, plan)
        self.user_files = user_files(config)  # as the workers loaded them: a later edit does not reach this run
        self.skip_watch = SkippedStepWatch(config.trainer.max_consecutive_skipped_steps)
        multi_turn = rollout.multi_turn
        self.signal_check = SignalCheck(
            config.trainer.fail_without_signal_steps,
            has_tools=workflows.workflow_name(rollout) == "multi_turn" and bool(multi_turn.tools),
        )

    def _prompt_batches(self):
        """Training prompt batches from where the run stands, across epochs, without end.

        Each epoch's shuffle is seeded by (data.seed, epoch), so the order of an
        epoch does not depend on how the run got there; a resumed run continues
        its epoch from the loader state it saved.
        """
        epoch, done_in_epoch = divmod(self.prompt_batches_used, self.steps_per_epoch)
        while True:
            if done_in_epoch == 0:
                self.train_loader.generator.manual_seed(self.config.data.seed + epoch)
            for prompts in self.train_loader:
                self.prompt_batches_used += 1
                yield prompts
            epoch, done_in_epoch = epoch + 1, 0

    def _steps(self, start_step: int):
        """(step, prompts) from start_step + 1 to total_steps."""
        self.prompt_stream = self._prompt_batches()
        for step in range(start_step + 1, self.total_steps + 1):
            yield step, next(self.prompt_stream)

    def _more_prompts(self) -> list[PromptSample]:
        """The next prompt batch, for online filtering's extra generation rounds."""
        return next(self.prompt_stream)

    def fit(self) -> None:
        start_step = self._resume()
        if self.config.trainer.val_only:
            if self.validator is not None:
                self.tracker.log(self.validator.run(start_step), start_step)
            self.tracker.close()
            return
        if self.config.trainer.val_before_train and self.validator is not None and start_step == 0:
            self.tracker.log(self.validator.run(0), 0)
        progress = ProgressBar(self.total_steps, start_step=start_step)
        trainer = self.config.trainer  # the time-based save counts from here: training, not start-up
        self.save_schedule = SaveSchedule(self.total_steps, trainer.save_freq, trainer.save_every_minutes)
        for step, prompts in self._steps(start_step):
            timings: dict[str, float] = {}
            with timer("step", timings):
                # 1. Rollout: n samples per prompt, images included (with online filtering, more
                #    prompts until the batch is full; for ReMax, a greedy baseline response too).
                self.workers.take_rollout_timings()  # drop what validation's rollouts left there
                self.workers.take_rollout_counts()
                with timer("gen", timings):
                    rollout = self.sampler.sample(prompts, self._more_prompts)
                gen_pieces = self.workers.take_rollout_timings()  # the engine's share of "gen", and the rest
                batch = rollout.batch
                # 2. Log-probs under the current and the reference policy (and a distillation teacher), and
                #    the critic's values, while the rewards are computed.
                # With one on-policy update per step, the update's forward gives the old log-probs (update_policy).
                old_from_update = self.plan.old_log_probs_from_forward(step, len(batch), rollout.on_policy)
                entropy = None
                if not old_from_update:
                    with timer("old", timings):
                        batch.old_log_probs, entropy = self.workers.compute_old_log_probs(batch)
                if self.plan.use_reference:
                    with timer("ref", timings):
                        batch.ref_log_probs = self.workers.compute_ref_log_probs(batch)
                if self.plan.use_teacher:  # on-policy distillation: the teacher scores the student's tokens
                    with timer("teacher", timings):
                        batch.teacher_log_probs = self.workers.compute_teacher_log_probs(batch)
                if self.plan.use_critic:
                    with timer("values", timings):
                        batch.values = self.workers.compute_values(batch)
                with timer("reward", timings):  # only the wait that the passes did not hide
                    rewards = rollout.collect()
                rewards.assign_to(batch)
                # 3. Token-level rewards (less the KL penalty when KL is in the reward), then advantages.
                with timer("adv", timings):
                    advantages = rollout.advantages or self.advantages(batch)
                advantages.assign_to(batch)
                # 4. Critic update, then the policy update (from step trainer.critic_warmup on).
                critic_metrics, actor_metrics, resync_metrics = {}, {}, {}
                if self.plan.use_critic:
                    with timer("update_critic", timings):
                        critic_metrics = self.workers.update_critic(batch, self.critic_settings)
                if self.plan.trains_actor(step):
                    with timer("update_actor", timings):
                        settings = self.actor_settings.at_version(rollout.version, batch)  # loglinear's v
                        update = self.workers.update_actor(batch, settings, old_from_update)
                    actor_metrics = update.metrics
                    if old_from_update:
                        batch.old_log_probs, entropy = update.log_probs, update.entropy
                    # 5. The rollout engine gets the new weights.
                    with timer("update_weights", timings):
                        resync_metrics = self.workers.sync_weights()
                    self.sampler.weights_synced()
                if self.config.trainer.rollout_data_dir:  # what the step trained, written once it has trained
                    write_generations(Path(self.config.trainer.rollout_data_dir) / f"step_{step}.jsonl", batch, step)
                self.workers.release()  # the workers drop the step's trajectories
                val_metrics = {}
                # A stop request skips validation: the grace period before SIGKILL is for saving.
                stopping = self.stop_requested.is_set()
                if self._validation_due(step) and not stopping:
                    with timer("testing", timings):
                        val_metrics = self.validator.run(step)
                # 6. Save when due, at the end, or when asked to stop.
                stopping = self.stop_requested.is_set()
                if self._save_due(step) or stopping:
                    with timer("save_checkpoint", timings):
                        self._save(step)
                    # A request that came during the save: this step is saved, so stop now, not a step later.
                    stopping = self.stop_requested.is_set()
            metrics = {
                **batch_metrics(batch, entropy, rollout.version),
                **mismatch_metrics(batch, self.actor_settings.at_version(rollout.version, batch)),
                **rewards.metrics,
                **rollout.metrics,
                **advantages.metrics,
                **critic_metrics,
                **actor_metrics,
                **resync_metrics,
                **val_metrics,
                **{f"timing_s/{k}": v for k, v in timings.items()},
                **{f"timing_s/gen/{k}": v for k, v in gen_pieces.items()},
                **self.perf.metrics(batch, timings),
                **self.sampler.step_metrics(timings["step"]),
            }
            self.tracker.log(metrics, step)
            # A run whose updates are all skipped (NaN) trains nothing: fail it, naming the steps.
            self.skip_watch.observe(step, metrics, self._optimizer_steps(len(batch), step))
            # A run with no learning signal (no tool ran, one reward for all, no advantage): said, or failed.
            self.signal_check.observe(step, metrics)
            progress.update(step)
            if stopping:
                print(f"stop requested: saved step {step}, exiting", flush=True)
                break
        progress.close()
        self.sampler.close()
        self.tracker.close()

    # ----------------------------------------------------------- checkpoints

    def _save_due(self, step: int) -> bool:
        return self.save_schedule.due(step)

    def _save(self, step: int) -> None:
        tmp = self.checkpoints.begin(step)
        try:
            self._write_checkpoint(tmp, step)
            verify_shards(tmp, self.plan.world_size)  # every rank's files, before COMPLETE
        except Exception:
            self.checkpoints.discard(tmp)  # a failed save (a full disk) leaves no full-size temp dir behind
            raise
        path = self.checkpoints.commit(tmp, step)
        self.save_schedule.saved()
        print(f"checkpoint: saved {path}", flush=True)

    def _write_checkpoint(self, tmp: Path, step: int) -> None:
        trainer_cfg = self.config.trainer
        self.workers.save_checkpoint(
            str(tmp),
            model_only=trainer_cfg.save_model_only,
            hf_weights=trainer_cfg.save_hf_weights and step == self.total_steps,
        )
        state = {
            "global_step": step,
            "next_group_id": self.next_group_id,
            "prompt_batches_used": self.prompt_batches_used,
            "advantages": self.advantages.state(),
            "sampler": self.sampler.state(),
            "dataloader": self.train_loader.state_dict(),
            "rng": rng_state(),
            "tracker": self.tracker.state(),
        }
        save_trainer_state(tmp, state)
        (tmp / "config.json").write_text(
            json.dumps(
                {
                    "config": to_dict(self.config),  # secrets as *** (vlmrl.config.redact)
                    "plan": mask_values(self.plan.as_dict()),
                    "fingerprint": fingerprint(self.config),
                    "user_files": self.user_files,  # hashed as the run loaded them (vlmrl.driver.user_files)
                },
                indent=2,
            )
        )
        if self.hooks.checkpoint_written is not None:
            self.hooks.checkpoint_written(step)

    def _resume(self) -> int:
        """Restore the checkpoint the run starts from, if any; return the step it holds, or 0."""
        path = self.resume_from
        if path is None:
            return 0
        state = load_trainer_state(path)
        step = state["global_step"]
        # Every step that trained the actor synced the engine once: its version continues from there.
        restored_optimizer = self.workers.load_checkpoint(str(path), max(self.plan.actor_updates_by(step), 1))
        self.prompt_batches_used = state.get("prompt_batches_used", step)
        # A checkpoint taken at the end of an epoch holds a finished loader; the next epoch starts fresh.
        if self.prompt_batches_used % self.steps_per_epoch:
            self.train_loader.load_state_dict(state["dataloader"])
        self.next_group_id = state["next_group_id"]
        self.advantages.load_state(state.get("advantages", {}))
        self.sampler.load_state(state.get("sampler", {}))
        set_rng_state(state["rng"])
        print(
            f"checkpoint: resumed from {path} at step {step}"
            + ("" if restored_optimizer else " (model only: optimizer state starts fresh)"),
            flush=True,
        )
        return step

    def _optimizer_steps(self, rows: int, step: int) -> dict[str, int]:
        """The optimizer steps this step's updates made, per trained model."""
        made = {}
        # The workers of a Ulysses group (worker.actor.ulysses_size of them) hold one share of the rows between them.
        world = self.plan.world_size // self.config.worker.actor.ulysses_size
        if self.plan.trains_actor(step):
            made["actor"] = optimizer_steps(rows, self.actor_settings.samples_per_update, world, self.actor_settings.ppo_epochs)
        if self.critic_settings is not None:
            made["critic"] = optimizer_steps(rows, self.critic_settings.samples_per_update, world, self.critic_settings.ppo_epochs)
        return made

    def _group_ids(self, n_prompts: int) -> list[int]:
        ids = list(range(self.next_group_id, self.next_group_id + n_prompts))
        self.next_group_id += n_prompts
        return ids

    def _validation_due(self, step: int) -> bool:
        if self.validator is None:
            return False
        freq = self.config.trainer.val_freq
        return step == self.total_steps or (freq > 0 and step % freq == 0)
