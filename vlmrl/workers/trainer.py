"""The trainer role: the FSDP2 actor and its optimizer, the frozen reference policy (unless KL is disabled),
the frozen distillation teacher (algorithm.distillation), the critic and its optimizer (GAE only), and the
trajectories of the step (``TrajectoryStore``).

Each pass takes a ``PassInput`` (row ids, the rows this worker does not hold
yet, per-token fields) and works on this worker's share of the batch. The
trainer knows nothing of the engine: the weights leave it through
``weight_stream`` (for a weight sync) and ``full_weights``.
"""

from __future__ import annotations

import resource
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vlmrl.config import Config, LoraConfig
from vlmrl.models import family_of
from vlmrl.plan import Plan, weights_dtype
from vlmrl.records import Trajectory
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.train import actor as actor_passes
from vlmrl.train import checkpoint as ckpt
from vlmrl.train import critic as critic_passes
from vlmrl.train import lora as lora_adapters
from vlmrl.train import ulysses
from vlmrl.train.critic import ValueModel
from vlmrl.train.fsdp_options import Meshes, ShardOptions, offloaders, shard, with_host_collectives
from vlmrl.train.on_device import uses
from vlmrl.train.lr_schedule import LRSchedule, ScheduleState, set_lr
from vlmrl.train.image_features import share_image_features
from vlmrl.train.models import load_pretrained, load_processor, tokenizer_of
from vlmrl.train.optimizers import build_optimizer
from vlmrl.train.micro_batches import MicroBatching, TokenCount
from vlmrl.weight_sync.bound_store import tcp_rendezvous
from vlmrl.workers.store import PassInput, TrajectoryStore


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _load_sharded(
    model_path: str,
    dtype: torch.dtype,
    mesh,
    trust_remote_code: bool,
    options: ShardOptions,
    lora: LoraConfig | None = None,
    override_config: dict | None = None,
) -> torch.nn.Module:
    """Load a HF VLM or text causal LM, add LoRA adapters when ``lora`` is given, and shard it with FSDP2."""
    model = load_pretrained(model_path, dtype, trust_remote_code, override_config)
    # The n samples of a prompt carry its image n times: the passes run the vision tower once per distinct image.
    share_image_features(model)
    if lora is not None:
        # Before sharding, so each adapter lands in its layer's FSDP unit and is sharded like the rest.
        lora_adapters.add_lora(model, lora)
    return shard(model, list(getattr(model, "_no_split_modules", None) or []), mesh, options)


def adamw(model: torch.nn.Module, optim) -> torch.optim.Optimizer:
    """The optimizer of ``optim.strategy`` (AdamW, or AdamW with bfloat16 states) over the trained parameters."""
    return build_optimizer([p for p in model.parameters() if p.requires_grad], optim)


def process_group_backend(device: str) -> str:
    """NCCL between GPU workers, gloo between CPU workers (the config's device, resolved into the plan)."""
    return "nccl" if device == "cuda" else "gloo"


def _peak_memory(device: str) -> dict[str, float]:
    """This process's peak memory so far: host (resident set) always, accelerator on GPU."""
    metrics = {"perf/cpu_memory_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB
    if device == "cuda":
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


@dataclass(frozen=True)
class ReferencePolicy:
    """The model the reference log-probs come from, said once.

    Without LoRA: a frozen copy of the starting weights. Under LoRA: the actor
    itself with its adapters switched off for the pass, which is the base
    model, so no second copy is loaded.
    """

    model: torch.nn.Module
    adapters_off: bool

    def context(self):
        return lora_adapters.adapters_disabled(self.model) if self.adapters_off else nullcontext()


class TrainerWorker:
    def __init__(self, config: Config, plan: Plan, rank: int, init_method: str):
        self.config, self.plan, self.rank = config, plan, rank
        actor_cfg = config.worker.actor
        device = plan.device
        if device == "cuda":
            # Ray gives each worker one GPU and makes it the only visible one.
            torch.cuda.set_device(0)
        # Across machines, rank 0's store listens on its node's address alone (vlmrl.weight_sync.bound_store).
        store = tcp_rendezvous(init_method, rank, plan.world_size, timedelta(minutes=30))
        dist.init_process_group(
            backend=with_host_collectives(process_group_backend(device), config),
            init_method=None if store is not None else init_method,
            store=store,
            rank=rank,
            world_size=plan.world_size,
            timeout=timedelta(minutes=30),
        )
        meshes = Meshes(device, plan.world_size)  # fsdp.fsdp_size: one mesh per shape, in the same order on all ranks
        torch.manual_seed(config.data.seed + rank)

        model_path = actor_cfg.model.model_path
        # A tokenizer for a text LM.
        self.processor = load_processor(model_path, actor_cfg.model.tokenizer_path, actor_cfg.model.trust_remote_code)
        self.tokenizer = tokenizer_of(self.processor)
        dtype = _dtype(plan.actor_dtype)
        trust = actor_cfg.model.trust_remote_code
        self.lora = actor_cfg.model.lora if actor_cfg.model.lora.rank > 0 else None
        actor_sharding = ShardOptions.from_config(actor_cfg.fsdp, device)
        overrides = dict(actor_cfg.model.override_config)
        self.actor = _load_sharded(
            model_path, dtype, meshes.of(actor_cfg.fsdp), trust, actor_sharding, self.lora, overrides
        )
        self.family = family_of(self.actor.config)
        """The model's family (``vlmrl.models``): its vision tower and the tokens a response may not hold."""
        if actor_cfg.model.freeze_vision_tower:
            for p in self.family.tower(self.actor).parameters():
                p.requires_grad_(False)
        if actor_cfg.model.enable_gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()
        self.optimizer = adamw(self.actor, actor_cfg.optim)
        self.ref = None
        if plan.use_reference and self.lora is None:  # under LoRA the reference is the actor, adapters off
            ref_sharding = ShardOptions.from_config(config.worker.ref.fsdp, device)
            ref_mesh = meshes.of(config.worker.ref.fsdp)
            self.ref = _load_sharded(model_path, _dtype(plan.ref_dtype), ref_mesh, trust, ref_sharding, None, overrides)
            self.ref.eval().requires_grad_(False)
        self.teacher = None
        if plan.use_teacher:  # on-policy distillation: a frozen model loaded as the reference is
            teacher_path = config.algorithm.distillation.teacher_path
            ref_sharding = ShardOptions.from_config(config.worker.ref.fsdp, device)
            self.teacher = _load_sharded(
                teacher_path, _dtype(plan.ref_dtype), meshes.of(config.worker.ref.fsdp), trust, ref_sharding
            )
            self.teacher.eval().requires_grad_(False)
        self.sequence = None
        """worker.actor.ulysses_size > 1: this worker's Ulysses group (``vlmrl.train.ulysses``), which the actor's,
        the reference's and the teacher's padding-free passes run over; its workers hold the same rows."""
        if actor_cfg.ulysses_size > 1:
            self.sequence = ulysses.SequenceGroup.of_world(actor_cfg.ulysses_size)  # a collective
            for model in (self.actor, self.ref, self.teacher):
                if model is not None:
                    ulysses.check_model(model, actor_cfg.ulysses_size, "worker.actor.ulysses_size")
                    ulysses.install(model)
        self.critic = self.critic_optimizer = self.critic_lora = self.critic_sequence = None
        if plan.use_critic:
            critic_cfg = config.worker.critic
            self.critic_lora = critic_cfg.model.lora if critic_cfg.model.lora.rank > 0 else None
            value_model = ValueModel.from_pretrained(
                plan.critic_model_path, _dtype(weights_dtype(config, "critic")), critic_cfg.model.trust_remote_code,
                dict(critic_cfg.model.override_config), self.critic_lora,
            )
            critic_sharding = ShardOptions.from_config(critic_cfg.fsdp, device)
            critic_mesh = meshes.of(critic_cfg.fsdp)
            if critic_cfg.ulysses_size > 1:  # validated equal to the actor's: the group's rows are the same
                ulysses.check_model(value_model.backbone, critic_cfg.ulysses_size, "worker.critic.ulysses_size")
                ulysses.install(value_model.backbone)
                self.critic_sequence = self.sequence
            self.critic = shard(value_model, value_model.no_split_modules, critic_mesh, critic_sharding)
            self.critic_optimizer = adamw(self.critic, critic_cfg.optim)
        # offload.*: what stays in host memory between the passes that use it (no-ops on CPU). Under LoRA
        # the reference pass runs on the actor, so "ref" names the actor's parameters.
        self.offloaders = offloaders("actor", self.actor, self.optimizer, actor_cfg.offload, actor_cfg.fsdp, device)
        if self.ref is not None:
            ref_cfg = config.worker.ref
            self.offloaders |= offloaders("ref", self.ref, None, ref_cfg.offload, ref_cfg.fsdp, device)
        else:
            self.offloaders["ref"] = self.offloaders["actor"]
        if self.teacher is not None:
            ref_cfg = config.worker.ref
            self.offloaders |= offloaders("teacher", self.teacher, None, ref_cfg.offload, ref_cfg.fsdp, device)
        if self.critic is not None:
            critic_cfg = config.worker.critic
            self.offloaders |= offloaders(
                "critic", self.critic, self.critic_optimizer, critic_cfg.offload, critic_cfg.fsdp, device
            )
        for part in self.offloaders.values():
            part.offload()

        self.reference = None
        if plan.use_reference:
            self.reference = ReferencePolicy(self.ref if self.ref is not None else self.actor, self.lora is not None)
        banned = self.family.banned_tokens
        self.allowed_tokens = sampling_mask(self.tokenizer, self.actor.config.get_text_config().vocab_size, banned)
        """The tokens a response may hold; the log-probs are restricted to them as the rollout's sampling is."""
        self.teacher_tokens = None
        if self.teacher is not None:  # the same tokenizer (validated), but the teacher's vocabulary may be padded
            teacher_vocab = self.teacher.config.get_text_config().vocab_size
            self.teacher_tokens = sampling_mask(self.tokenizer, teacher_vocab, banned)
        self.experience_batching = MicroBatching(
            actor_cfg.micro_batch_size_per_device_for_experience,
            plan.experience_token_budget,
            actor_cfg.padding_free,
            actor_cfg.share_prompts,
        )
        self.experience_tokens = TokenCount()
        """Tokens of the log-prob passes since the last update, for its padding metric."""
        self.store = TrajectoryStore(
            config.data.max_prompt_length, config.data.max_response_length, self.tokenizer.pad_token_id
        )
        self.schedule_states = {"actor": ScheduleState(), "critic": ScheduleState()}
        """Scheduler steps taken by each trained model (its learning-rate schedule's whole state)."""

    def _scheduled_lr(self, model: str, optimizer: torch.optim.Optimizer, schedule: LRSchedule | None) -> float:
        """Set this update's learning rate from the schedule and advance it; the rate the update runs at."""
        if schedule is None:
            return optimizer.param_groups[0]["lr"]
        state = self.schedule_states[model]
        lr = schedule.lr(state.steps)
        set_lr(optimizer, lr)
        state.steps += 1
        return lr

    # ----------------------------------------------------------- the step's rows

    def hold(self, trajectories: list[Trajectory]) -> None:
        """Keep a rollout's trajectories (pixels included) for the passes of this step."""
        self.store.hold(trajectories)

    def release(self) -> None:
        """The step is over: drop its trajectories."""
        self.store.release()

    # ------------------------------------------------------------- log-probs

    @uses("actor")
    def compute_old_log_probs(self, request: PassInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_probs, entropy)`` of the responses under the current actor, each ``(b, R)``."""
        self.actor.eval()
        return actor_passes.compute_log_probs(
            self.actor, self.store.batch(request), self.experience_batching, self.allowed_tokens,
            self.experience_tokens, sequence=self.sequence,
        )  # fmt: skip

    @uses("ref")
    def compute_ref_log_probs(self, request: PassInput) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("reference log-probs requested but the run has no reference model (KL is off)")
        self.reference.model.eval()
        with self.reference.context():
            log_probs, _ = actor_passes.compute_log_probs(
                self.reference.model, self.store.batch(request), self.experience_batching, self.allowed_tokens,
                self.experience_tokens, with_entropy=False, sequence=self.sequence,
            )  # fmt: skip
        return log_probs

    @uses("teacher")
    def compute_teacher_log_probs(self, request: PassInput) -> torch.Tensor:
        """``(b, R)`` the distillation teacher's log-probs of the sampled tokens (``algorithm.distillation``)."""
        if self.teacher is None:
            raise RuntimeError("teacher log-probs requested but the run has no teacher (algorithm.distillation)")
        log_probs, _ = actor_passes.compute_log_probs(
            self.teacher, self.store.batch(request), self.experience_batching, self.teacher_tokens,
            self.experience_tokens, with_entropy=False, sequence=self.sequence,
        )  # fmt: skip
        return log_probs

    # ---------------------------------------------------------------- update

    @uses("actor", "actor_optimizer")
    def update_actor(
        self, request: PassInput, settings: actor_passes.UpdateSettings, old_from_forward: bool
    ) -> actor_passes.ActorUpdate:
        lr = self._scheduled_lr("actor", self.optimizer, settings.lr_schedule)
        update = actor_passes.update_policy(
            self.actor, self.optimizer, self.store.batch(request), settings, self.allowed_tokens, old_from_forward,
            sequence=self.sequence,
        )
        metrics = update.metrics
        metrics["actor/lr"] = lr  # the rate this step's updates ran at (EasyR1 logs the same for the actor)
        metrics.update(_peak_memory(self.plan.device))  # host: the process's peak so far, rollouts included
        if self.experience_tokens.computed:
            metrics["actor/padding_share_logprob"] = self.experience_tokens.padding_share
        self.experience_tokens = TokenCount()
        return update

    @uses("actor")
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the actor's full state dict (HF names) on CPU, on rank 0 (the others get an empty dict).

        Under LoRA: the merged weights, as vLLM and the HF export get them.
        """
        full = get_model_state_dict(self.actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dict(self.hf_weights(full.items())) if self.lora else full

    def hf_weights(self, items):
        """LoRA: gathered ``(name, tensor)`` pairs to merged weights under the HF checkpoint names."""
        return lora_adapters.merged_weights(items, lora_adapters.scaling(self.lora))

    # ---------------------------------------------------------------- critic

    @uses("critic")
    def compute_values(self, request: PassInput) -> torch.Tensor:
        """``(b, R)`` the critic's values of the responses' states."""
        if self.critic is None:
            raise RuntimeError("values requested but the run has no critic (only adv_estimator=gae trains one)")
        critic = self.config.worker.critic
        batching = MicroBatching(
            critic.micro_batch_size_per_device_for_experience,
            self.plan.critic_experience_token_budget,
            critic.padding_free,
        )
        return critic_passes.compute_values(self.critic, self.store.batch(request), batching, self.critic_sequence)

    @uses("critic", "critic_optimizer")
    def update_critic(self, request: PassInput, settings: critic_passes.CriticSettings) -> dict[str, float]:
        if self.critic is None:
            raise RuntimeError("critic update requested but the run has no critic (only adv_estimator=gae trains one)")
        lr = self._scheduled_lr("critic", self.critic_optimizer, settings.lr_schedule)
        metrics = critic_passes.update_critic(
            self.critic, self.critic_optimizer, self.store.batch(request), settings, self.critic_sequence
        )
        metrics["critic/lr"] = lr  # the rate this step's updates ran at (EasyR1 logs the next step's)
        return metrics

    # ----------------------------------------------------------- checkpoints
    @uses("actor", "actor_optimizer", "critic", "critic_optimizer")
    def save_checkpoint(self, path: str, model_only: bool, hf_weights: bool) -> None:
        """Collective: the sharded actor (and optimizer) into ``path``/actor, plus its HF config and processor.

        With ``hf_weights`` rank 0 also writes the full weights there as a HF model directory.
        """
        actor_dir = Path(path) / "actor"
        ckpt.save_actor(actor_dir, self.actor, self.optimizer, self.rank, model_only)
        if self.lora is not None and self.rank == 0:
            ckpt.save_lora_config(actor_dir, self.lora)
        if self.critic is not None:
            ckpt.save_actor(Path(path) / "critic", self.critic, self.critic_optimizer, self.rank, model_only)
            if self.critic_lora is not None and self.rank == 0:
                ckpt.save_lora_config(Path(path) / "critic", self.critic_lora)
        if self.rank == 0:  # every rank steps its schedule alike; also in model-only checkpoints
            self.schedule_states["actor"].save(actor_dir)
            if self.critic is not None:
                self.schedule_states["critic"].save(Path(path) / "critic")
        full = ckpt.full_model_state(self.actor) if hf_weights else None
        if full is not None and self.lora is not None:
            full = dict(self.hf_weights(full.items()))  # plain HF weights: the directory loads without peft
        if self.rank == 0:
            hf_dir = actor_dir / "huggingface"
            if full is not None:
                self.actor.save_pretrained(hf_dir, state_dict=full)
                ckpt.write_checkpoint_layout(hf_dir, self.family.engine_weight)  # so that vLLM loads it too
            else:
                self.actor.config.save_pretrained(hf_dir)
                if self.actor.generation_config is not None:
                    self.actor.generation_config.save_pretrained(hf_dir)
            self.processor.save_pretrained(hf_dir)
        dist.barrier()

    @uses("actor", "actor_optimizer", "critic", "critic_optimizer")
    def load_checkpoint(self, path: str) -> bool:
        """Collective: restore the actor (and optimizer) from ``path``/actor, and the critic if saved.

        Returns whether optimizer state was restored. The engine's weights are the caller's to resync.
        """
        ckpt.check_lora_matches(Path(path) / "actor", self.lora)
        restored_optimizer = ckpt.load_actor(Path(path) / "actor", self.actor, self.optimizer, self.rank)
        if self.critic is not None and (Path(path) / "critic").is_dir():
            ckpt.check_lora_matches(Path(path) / "critic", self.critic_lora, "worker.critic.model.lora")
            ckpt.load_actor(Path(path) / "critic", self.critic, self.critic_optimizer, self.rank)
        for model in ("actor", "critic"):
            # A checkpoint from before schedules were saved starts its schedule over.
            self.schedule_states[model] = ScheduleState.load(Path(path) / model) or ScheduleState()
        return restored_optimizer
