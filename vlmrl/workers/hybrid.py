"""The colocated worker: a trainer and a rollout engine in one Ray actor process, taking turns.

``HybridWorker`` composes the two roles (``TrainerWorker``, ``RolloutWorker``)
and the in-process weight sync between them, as EasyR1 and verl colocate
them: the engine samples, the trainer keeps what was sampled and trains on it,
then the trainer's new weights stream into the engine. The driver calls these
methods through ``WorkerGroup``; each call works on this worker's share.

Disaggregated (``plan.rollout_servers``), the same class is the trainer worker alone: it builds no
engine, and its weight sync pushes the full weights from rank 0 to the rollout servers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from vlmrl.config import Config, PartialRollout, RewardModelPlacement
from vlmrl.config.options import WeightTransfer
from vlmrl.heap import freeze_survivors, started
from vlmrl.plan import Plan
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import InterruptMode, Sampling
from vlmrl.train.on_device import uses

if TYPE_CHECKING:
    from vlmrl.train import actor as actor_passes
    from vlmrl.train import critic as critic_passes
    from vlmrl.weight_sync import WeightSync
    from vlmrl.weight_sync.collective import WeightGroup
    from vlmrl.workers.reward_model import RewardModelServer
    from vlmrl.workers.rollout import RolloutWorker
    from vlmrl.workers.store import PassInput

# The roles (trainer, engine, weight sync, reward model) are imported in the constructor, in the worker's own
# process: the driver imports this module to start the workers, and starts them sooner without those imports
# (transformers, torchvision, SciPy, torch.distributed.tensor: 4.3-4.6 s on 2 cores beyond the config and Ray).


_INTERRUPT = {PartialRollout.keep_kv: InterruptMode.continue_, PartialRollout.reprefill: InterruptMode.reprefill}
"""What a weight push does to the servers' responses in flight, per ``worker.rollout.async_rl.partial_rollout``."""


class HybridWorker:
    def __init__(self, config: Config, plan: Plan, rank: int, init_method: str, servers: list | None = None):
        """``servers``: disaggregated, the rollout servers' actor handles (``plan.rollout_servers`` of them): this
        worker builds no engine, and rank 0 pushes the weights to them."""
        from vlmrl.weight_sync import EngineSink, WeightSync
        from vlmrl.weight_sync.collective import weight_transfer
        from vlmrl.workers.reward_model import RewardModelServer
        from vlmrl.workers.rollout import RolloutWorker
        from vlmrl.workers.trainer import TrainerWorker

        self.plan = plan
        self.trainer = TrainerWorker(config, plan, rank, init_method)
        rollout_cfg = config.worker.rollout
        self.rollout_dtype = getattr(torch, rollout_cfg.dtype.value)
        self.bucket_bytes = rollout_cfg.resync_bucket_mb << 20
        self.servers = servers
        self.interrupt = _INTERRUPT[rollout_cfg.async_rl.partial_rollout]
        self.transfer = weight_transfer(rollout_cfg.async_rl.weight_transfer, plan.device)
        """Disaggregated: how rank 0 sends the weights to the servers (object store, or the group's broadcast)."""
        self.weight_group: WeightGroup | None = None
        """Rank 0, collective transfer: its member of the weight-transfer group (``open_weight_group``)."""
        self.sync_interval = rollout_cfg.async_rl.weight_sync_interval if servers else 1
        """Disaggregated: the servers get the weights every this many updates (the versions in between are the
        trainer's only, and the servers' tokens carry the version they last got)."""
        self.rollout: RolloutWorker | None = None
        self.weight_sync: WeightSync | None = None
        if not plan.rollout_servers:
            # vLLM runs full collections while it sizes its memory; frozen, the trainer's heap is not walked.
            freeze_survivors()
            self.rollout = RolloutWorker(
                config, plan, rank, self.trainer.tokenizer, self.trainer.allowed_tokens, self.trainer.processor
            )
            self.weight_sync = WeightSync(
                self.trainer.actor,
                EngineSink(self.rollout.engine, self.rollout.kind.paused),
                self.rollout_dtype,
                bucket_bytes=self.bucket_bytes,
                transform=self.trainer.hf_weights if self.trainer.lora else None,
            )
        self.offloaders = self.trainer.offloaders  # what ``uses`` moves to the device around a call
        rm = config.worker.reward.reward_model
        self.reward_model = (
            RewardModelServer(
                rm, plan.device, min_pixels=config.data.min_pixels, max_pixels=config.data.max_pixels, colocated=True
            )
            if rm.model_path and rm.placement is RewardModelPlacement.colocated
            else None
        )
        """A colocated judge or score model (``vlmrl.workers.reward_model``); the reward manager calls it."""
        self.policy_version = 0
        """Updates synced into the engine so far: the version of the weights it samples with."""
        # GPU memory: torch keeps one resettable peak; each rollout resets it to measure its own peak, so the
        # run's peak before that reset is kept here. The rollouts' peak since the last update goes out with it.
        self.gpu_peak_bytes, self.rollout_gpu_peak_bytes = 0, 0
        started()  # the models, the engine and the libraries live as long as this process (vlmrl.heap)

    def pad_token_id(self) -> int:
        return self.trainer.tokenizer.pad_token_id

    # ---------------------------------------------------------------- rollout

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling, keep: bool
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Sample; with ``keep`` the trainer holds the trajectories for this step's passes.

        Returns them without pixels or media (the driver holds the prompts'), and the call's stats.
        """
        if self.rollout is None:
            raise RuntimeError("this worker has no engine: disaggregated, the rollout servers generate")
        on_gpu = self.plan.device == "cuda"
        if on_gpu:
            self.gpu_peak_bytes = max(self.gpu_peak_bytes, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        trajectories, stats = self.rollout.generate(prompts, group_ids, sampling)
        if on_gpu:  # vLLM allocates through torch in this process (sleep mode: a torch memory pool); not checked on a GPU
            self.rollout_gpu_peak_bytes = max(self.rollout_gpu_peak_bytes, torch.cuda.max_memory_allocated())
        if keep:
            self.trainer.hold(trajectories)
        return [t.slim() for t in trajectories], stats

    def release(self) -> None:
        self.trainer.release()

    # ---------------------------------------------------------------- trainer passes

    def compute_old_log_probs(self, request: PassInput) -> tuple[torch.Tensor, torch.Tensor]:
        return self.trainer.compute_old_log_probs(request)

    def compute_ref_log_probs(self, request: PassInput) -> torch.Tensor:
        return self.trainer.compute_ref_log_probs(request)

    def compute_teacher_log_probs(self, request: PassInput) -> torch.Tensor:
        return self.trainer.compute_teacher_log_probs(request)

    def compute_values(self, request: PassInput) -> torch.Tensor:
        return self.trainer.compute_values(request)

    def update_critic(self, request: PassInput, settings: critic_passes.CriticSettings) -> dict[str, float]:
        return self.trainer.update_critic(request, settings)

    def update_actor(
        self, request: PassInput, settings: actor_passes.UpdateSettings, old_from_forward: bool
    ) -> actor_passes.ActorUpdate:
        update = self.trainer.update_actor(request, settings, old_from_forward)
        if self.plan.device == "cuda":
            run_peak = max(self.gpu_peak_bytes, self.rollout_gpu_peak_bytes, torch.cuda.max_memory_allocated())
            update.metrics["perf/max_memory_allocated_gb"] = run_peak / 2**30
            update.metrics["perf/rollout/max_memory_allocated_gb"] = self.rollout_gpu_peak_bytes / 2**30
            self.rollout_gpu_peak_bytes = 0
        return update

    # ---------------------------------------------------------------- a colocated reward model

    def reward_model_generate(self, conversations: list, sampling: dict) -> tuple[list[str], int]:
        return self._reward_model().generate(conversations, sampling)

    def reward_model_score(self, conversations: list) -> list[float]:
        return self._reward_model().score(conversations)

    def _reward_model(self) -> RewardModelServer:
        if self.reward_model is None:
            raise RuntimeError("this worker holds no reward model (worker.reward.reward_model.placement=separate?)")
        return self.reward_model

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.full_weights()

    # ---------------------------------------------------------------- weights

    @uses("actor")
    def sync_weights(self) -> dict[str, float]:
        """Collective: stream the actor's weights into this worker's engine, or (disaggregated) gather them and
        push them from rank 0 to the rollout servers; the resync's seconds (and largest bucket, or bytes pushed)."""
        version = self.policy_version + 1
        self.policy_version = version
        if self.servers is None:
            return self.weight_sync.sync(version)
        if version % self.sync_interval:  # not a sync this update (weight_sync_interval)
            return {"perf/resync_skipped": 1.0}
        return self._push(version)

    def open_weight_group(self) -> None:
        """Disaggregated with the collective transfer, on rank 0: make the weight-transfer group with the rollout
        servers (once, after they have started; NCCL on GPU, gloo on CPU). Nothing to do otherwise."""
        if self.trainer.rank != 0 or not self.servers or self.transfer is not WeightTransfer.collective:
            return
        if self.weight_group is None:
            from vlmrl.weight_sync.collective import backend_of, open_group, rendezvous_host

            self.weight_group = open_group(self.servers, backend_of(self.plan.device), rendezvous_host())

    def _push(self, version: int) -> dict[str, float]:
        """Collective: the full weights (merged under LoRA) on rank 0, cast to the engine's dtype and loaded into
        every server as ``version``, through the object store or broadcast in the weight-transfer group
        (``transfer``); responses in flight are interrupted as configured."""
        from vlmrl.weight_sync.collective import broadcast_weights
        from vlmrl.weight_sync.object_store import push_weights

        start = time.perf_counter()
        weights = self.trainer.full_weights()  # rank 0's dict; the other ranks' are empty
        metrics = {}
        if self.trainer.rank == 0:
            named = ((name, tensor.to(self.rollout_dtype)) for name, tensor in weights.items())
            if self.transfer is WeightTransfer.collective:
                if self.weight_group is None:
                    raise RuntimeError("the weight-transfer group is not open: call open_weight_group first")
                metrics = broadcast_weights(
                    named, self.weight_group, self.servers, version, self.interrupt, self.bucket_bytes
                )
            else:
                metrics = push_weights(named, self.servers, version, self.interrupt, self.bucket_bytes)
        return {**metrics, "timing_s/resync_worker": time.perf_counter() - start}

    def save_checkpoint(self, path: str, model_only: bool, hf_weights: bool) -> None:
        self.trainer.save_checkpoint(path, model_only, hf_weights)

    def load_checkpoint(self, path: str, version: int = 1) -> bool:
        """Collective: restore the trainer from ``path`` and resync the engine, which then samples as policy
        ``version`` (the syncs the saved run had made, so token versions continue); whether optimizer state
        came back."""
        restored_optimizer = self.trainer.load_checkpoint(path)
        self.policy_version = max(version, 1) - 1
        if self.servers is None:
            self.sync_weights()
        else:  # whatever the interval: the servers restarted on the initial weights
            self.policy_version += 1
            self._push(self.policy_version)
        return restored_optimizer
