"""Settings that must agree with each other: the KL term, what each advantage estimator needs, LoRA, the
devices, and the settings vlmrl accepts but cannot honour yet.
"""

from __future__ import annotations

import re

from vlmrl.workflows import workflow_name
from vlmrl.algos import ADVANTAGE_ESTIMATORS, AdvantageEstimator, KLControllerType, KLEstimator, LossAvgMode
from vlmrl.config import AlgorithmConfig, Config, Device, LoraConfig
from vlmrl.plan import (
    Cluster,
    decoupled_loss,
    device,
    kl_in_reward,
    rollout_log_probs,
    uses_critic,
    uses_reference,
    weights_dtype,
    world_size,
)

__all__ = [
    "GROUP_ESTIMATORS",
    "device_problems",
    "estimator_problems",
    "kl_problems",
    "lora_problems",
    "loss_mode_problems",
    "not_supported_yet",
    "proximal_problems",
]

GROUP_ESTIMATORS = {e for e, spec in ADVANTAGE_ESTIMATORS.items() if spec.needs_groups}
"""Estimators whose baseline comes from the other samples of the same prompt."""


def kl_problems(algo: AlgorithmConfig) -> list[str]:
    problems = []
    if algo.disable_kl:
        return problems
    if not algo.kl_coef > 0:
        problems.append(
            f"algorithm.kl_coef={algo.kl_coef} with algorithm.disable_kl=false: the KL weight must be positive; "
            "set a positive kl_coef, or algorithm.disable_kl=true to train without KL (and without a reference model)"
        )
    if algo.kl_type is KLControllerType.adaptive:
        if algo.use_kl_loss:
            problems.append(
                "algorithm.kl_type=adaptive with algorithm.use_kl_loss=true: the adaptive controller steers a KL "
                "penalty in the reward, not the KL loss; set use_kl_loss=false or kl_type=fixed"
            )
        for key, value in (
            ("algorithm.kl_target", algo.kl_target),
            ("algorithm.kl_horizon", algo.kl_horizon),
        ):
            if not value > 0:
                problems.append(
                    f"{key}={value} with algorithm.kl_type=adaptive: must be positive"
                )
    return problems


def estimator_problems(config: Config) -> list[str]:
    """What each advantage estimator needs: groups, a critic, a greedy baseline."""
    problems = []
    algo, rollout, trainer = config.algorithm, config.worker.rollout, config.trainer
    est = algo.adv_estimator
    if est in GROUP_ESTIMATORS and rollout.n < 2:
        problems.append(
            f"worker.rollout.n={rollout.n}: {est.value} compares samples within a group, so it needs n >= 2; "
            "set worker.rollout.n=2 or more"
        )
    if est is AdvantageEstimator.remax and rollout.temperature == 0:
        problems.append(
            "worker.rollout.temperature=0 with algorithm.adv_estimator=remax: ReMax's baseline is a greedy "
            "response, so greedy samples have advantage 0; set a temperature > 0"
        )
    elif rollout.temperature == 0 and not trainer.val_only:
        # Greedy training samples: a group's n samples are one response (advantage 0 under every group
        # estimator), and the policy gradient needs samples drawn from the policy. The run would train nothing.
        problems.append(
            "worker.rollout.temperature=0: training would sample greedily, so every sample of a prompt is the same "
            "response and the update learns nothing; set a temperature > 0 (1.0 samples the policy itself). "
            "Greedy decoding is for validation: worker.rollout.val_override_config.temperature (0 by default)"
        )
    if not uses_critic(config):
        if config.worker.critic.model.model_path:
            problems.append(
                f"worker.critic.model.model_path is set but algorithm.adv_estimator={est.value} uses no critic; "
                "set algorithm.adv_estimator=gae to train one, or remove worker.critic.model.model_path"
            )
        if trainer.critic_warmup > 0:
            problems.append(
                f"trainer.critic_warmup={trainer.critic_warmup} but algorithm.adv_estimator={est.value} uses no "
                "critic; set algorithm.adv_estimator=gae, or trainer.critic_warmup=0"
            )
    if algo.online_filtering and not algo.filter_low < algo.filter_high:
        problems.append(
            f"algorithm.filter_low={algo.filter_low} >= algorithm.filter_high={algo.filter_high}: online filtering "
            "would keep no group; make filter_low smaller than filter_high"
        )
    actor = config.worker.actor
    if decoupled_loss(config) and not rollout_log_probs(config):
        why = "worker.actor.use_decoupled_loss=true" if actor.use_decoupled_loss else _why_decoupled(config)
        problems.append(
            f"worker.rollout.calculate_log_probs=false with {why}: the decoupled loss weights each token by old / "
            "behaviour, and the behaviour log-probs are vLLM's; set worker.rollout.calculate_log_probs=true "
            "(or leave it unset)"
        )
    if decoupled_loss(config) and not actor.behaviour_weight_cap >= 1:
        problems.append(
            f"worker.actor.behaviour_weight_cap={actor.behaviour_weight_cap}: must be at least 1 (a weight of 1 is "
            "a token the engine and the actor agree on)"
        )
    return problems


def proximal_problems(config: Config) -> list[str]:
    """``worker.actor.proximal_log_probs=loglinear``: what the interpolated proximal log-probs need and replace."""
    actor = config.worker.actor
    if actor.proximal_log_probs != "loglinear":
        return []
    key = "worker.actor.proximal_log_probs=loglinear"
    if not decoupled_loss(config):
        return [
            f"{key} without worker.actor.use_decoupled_loss=true: the proximal log-probs are the decoupled loss's; "
            "set worker.actor.use_decoupled_loss=true and worker.rollout.calculate_log_probs=true, or "
            "worker.actor.proximal_log_probs=recompute"
        ]
    problems = []
    if kl_in_reward(config):
        problems.append(
            f"{key} with the KL in the reward (algorithm.use_kl_loss=false): the penalty reads the old log-probs "
            "before the update, and loglinear runs no pass to give them; set algorithm.use_kl_loss=true or "
            "algorithm.disable_kl=true, or worker.actor.proximal_log_probs=recompute"
        )
    if actor.old_log_prob_pass == "always":
        problems.append(
            f"worker.actor.old_log_prob_pass=always with {key}: the update interpolates the proximal log-probs "
            "and reads no pass; set worker.actor.old_log_prob_pass=auto, or worker.actor.proximal_log_probs=recompute"
        )
    return problems


def loss_mode_problems(config: Config) -> list[str]:
    """Loss aggregation modes a loss cannot honour.

    ``per_rollout_mean`` is valid for every actor: a row without a rollout id is
    a rollout of its own, so with one row per rollout it is seq_mean_token_mean.
    The critic's update does not weigh its rows by rollout.
    """
    critic = config.worker.critic
    if uses_critic(config) and critic.loss_avg_mode is LossAvgMode.per_rollout_mean:
        return [
            "worker.critic.loss_avg_mode=per_rollout_mean: the critic's value loss does not weigh its rows by "
            "rollout (only the actor's update does); set worker.critic.loss_avg_mode=seq_mean_token_mean, which "
            "is the same when every rollout is one row, as it is under GAE"
        ]
    return []


def lora_problems(config: Config) -> list[str]:
    """The LoRA settings of the actor, and of the critic when the run trains one."""
    problems = _lora_section_problems(config.worker.actor.model.lora, "worker.actor.model.lora")
    if uses_critic(config):
        problems += _lora_section_problems(config.worker.critic.model.lora, "worker.critic.model.lora")
    lora, key = config.worker.actor.model.lora, "worker.actor.model.lora"
    ref_dtype = config.worker.ref.fsdp.torch_dtype
    if lora.rank > 0 and uses_reference(config) and ref_dtype is not None and ref_dtype.value != weights_dtype(
        config, "actor"
    ):
        problems.append(
            f"worker.ref.fsdp.torch_dtype={ref_dtype.value} with {key}.rank={lora.rank}: under LoRA the reference "
            f"model is the actor's base weights, in the actor's dtype ({weights_dtype(config, 'actor')}); "
            "unset worker.ref.fsdp.torch_dtype (null)"
        )
    return problems


def _lora_section_problems(lora: LoraConfig, key: str) -> list[str]:
    problems = []
    if lora.rank < 0:
        problems.append(f"{key}.rank={lora.rank}: must be 0 (train the full model) or a positive LoRA rank, e.g. 8")
    if lora.rank <= 0:
        return problems
    if not lora.alpha > 0:
        problems.append(
            f"{key}.alpha={lora.alpha}: must be positive (the update is scaled by alpha / rank); e.g. {2 * lora.rank}"
        )
    if not [t for t in lora.target_modules.split(",") if t.strip()]:
        problems.append(
            f"{key}.target_modules is empty: set it to all-linear or comma-separated Linear module names (q_proj,v_proj)"
        )
    if lora.exclude_modules is not None:
        try:
            re.compile(lora.exclude_modules)
        except re.error as e:
            problems.append(f"{key}.exclude_modules={lora.exclude_modules!r}: not a regular expression ({e})")
    return problems


def device_problems(config: Config, cluster: Cluster) -> list[str]:
    """Workers, tensor-parallel engines, shard groups and sequence-parallel groups must fit the devices."""
    problems = _shard_group_problems(config)
    trainer, rollout = config.trainer, config.worker.rollout
    if trainer.device is Device.cuda and cluster.gpus == 0:
        problems.append(
            "trainer.device=cuda but this machine has no visible GPU; set trainer.device=auto or cpu"
        )
    on_gpu = device(config, cluster) == "cuda"
    if (
        on_gpu
        and trainer.nnodes == 1
        and cluster.gpus
        and trainer.n_gpus_per_node > cluster.gpus
    ):
        problems.append(
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this machine has {cluster.gpus} GPU(s); "
            f"set trainer.n_gpus_per_node to at most {cluster.gpus}"
        )
    tp = rollout.tensor_parallel_size
    # On rollout servers an engine's shards are the server's own processes (vlmrl.workers.rollout_server), not
    # trainer workers: the checks of engines over workers are the colocated engines'.
    a = rollout.async_rl
    on_servers = a.enable and a.placement == "disaggregated"
    if tp > 1 and not on_servers and trainer.n_gpus_per_node % tp:
        where = "GPUs" if on_gpu else "workers"
        problems.append(
            f"worker.rollout.tensor_parallel_size={tp} does not divide trainer.n_gpus_per_node="
            f"{trainer.n_gpus_per_node}: an engine's {where} must be on one node; pick a divisor of n_gpus_per_node"
        )
    mini = config.data.mini_rollout_batch_size
    engines = world_size(config) // tp if tp >= 1 and world_size(config) % tp == 0 and not on_servers else None
    if mini is not None and mini >= 1:
        if config.data.rollout_batch_size % mini:
            problems.append(
                f"data.mini_rollout_batch_size={mini} does not divide data.rollout_batch_size="
                f"{config.data.rollout_batch_size}: a step is generated in calls of mini_rollout_batch_size prompts; "
                "pick a divisor, or null to generate the step at once"
            )
        elif engines and mini % engines:
            problems.append(
                f"data.mini_rollout_batch_size={mini} does not split over the {engines} vLLM engine(s) (workers / "
                "worker.rollout.tensor_parallel_size): each call gives every engine the same number of prompts; "
                f"make it a multiple of {engines}"
            )
    if not config.worker.hybrid_engine:
        problems.append(
            "worker.hybrid_engine=false: vlmrl always runs the actor and its vLLM engine in the same worker "
            "(the weights move in process); set worker.hybrid_engine=true"
        )
    if tp > 1 and not on_servers and workflow_name(rollout) == "multi_turn":
        problems.append(
            f"worker.rollout.tensor_parallel_size={tp} with worker.rollout.workflow=multi_turn: the agent loop "
            "runs its tools in each worker, and the workers of a tensor-parallel engine must send it the same "
            "requests; set worker.rollout.tensor_parallel_size=1 for multi-turn rollouts"
        )
    actor = config.worker.actor
    if actor.share_prompts and actor.padding_free:
        problems.append(
            "worker.actor.share_prompts=true with worker.actor.padding_free=true: prompts are shared in the padded "
            "passes (a packed row would need a block mask over the whole row); set one of them false"
        )
    if actor.share_prompts and actor.model.enable_gradient_checkpointing:
        problems.append(
            "worker.actor.share_prompts=true with worker.actor.model.enable_gradient_checkpointing=true: shared "
            "prompts keep their keys and values in transformers' cache, which gradient checkpointing drops; set "
            "one of them false"
        )
    sections = [("worker.actor", config.worker.actor)]
    if uses_critic(config):
        sections.append(("worker.critic", config.worker.critic))
    for section, cfg in sections:
        if cfg.ulysses_size > 1:
            if not cfg.padding_free:
                problems.append(
                    f"{section}.ulysses_size={cfg.ulysses_size} with {section}.padding_free=false: Ulysses sequence "
                    f"parallelism splits packed sequences; set {section}.padding_free=true or ulysses_size=1"
                )
            if world_size(config) % cfg.ulysses_size:
                problems.append(
                    f"{section}.ulysses_size={cfg.ulysses_size} does not divide the {world_size(config)} worker(s); "
                    "pick a divisor of trainer.n_gpus_per_node x trainer.nnodes"
                )
    critic = config.worker.critic
    if uses_critic(config) and critic.ulysses_size > 1 and critic.ulysses_size != actor.ulysses_size:
        problems.append(
            f"worker.critic.ulysses_size={critic.ulysses_size} with worker.actor.ulysses_size={actor.ulysses_size}: "
            "the workers of a Ulysses group share their rows, and the actor's groups deal the rows to the workers; "
            f"set worker.critic.ulysses_size to 1 or to worker.actor.ulysses_size={actor.ulysses_size}"
        )
    return problems


def _shard_group_problems(config: Config) -> list[str]:
    """``fsdp.fsdp_size`` of each model the run builds: -1 (all workers) or a divisor of the workers."""
    world = world_size(config)
    sections = [("worker.actor", config.worker.actor)]
    if uses_reference(config):
        sections.append(("worker.ref", config.worker.ref))
    if uses_critic(config):
        sections.append(("worker.critic", config.worker.critic))
    problems = []
    for section, cfg in sections:
        size = cfg.fsdp.fsdp_size
        if size == -1 or (size >= 1 and world % size == 0):
            continue
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        problems.append(
            f"{section}.fsdp.fsdp_size={size} does not divide the {world} worker(s) (trainer.n_gpus_per_node x "
            f"trainer.nnodes): each shard group holds fsdp_size workers; set -1 to shard over all of them, or "
            f"one of {divisors} for hybrid sharding"
        )
    return problems


def not_supported_yet(config: Config, cluster: Cluster) -> list[str]:
    """Settings vlmrl accepts but cannot honour yet, where ignoring them would change what trains or the memory it takes.

    One entry per feature; each goes when the feature lands.
    """
    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    todo: list[tuple[bool, str, str]] = [  # (applies?, "key=value", fix)
        (algo.adv_estimator not in ADVANTAGE_ESTIMATORS, f"algorithm.adv_estimator={algo.adv_estimator.value}",
         "use one of: " + ", ".join(e.value for e in ADVANTAGE_ESTIMATORS)),
        (uses_reference(config) and algo.kl_penalty is KLEstimator.full, "algorithm.kl_penalty=full",
         "the actor keeps only the sampled tokens' log-probs; use low_var_kl, kl, mse or abs"),
        (not config.worker.reward.skip_special_tokens, "worker.reward.skip_special_tokens=false",
         "set worker.reward.skip_special_tokens=true"),
    ]  # fmt: skip
    # The fsdp.* options (hybrid sharding included), LoRA and Ulysses sequence parallelism on the actor and the
    # critic are implemented (vlmrl/train/fsdp_options.py, vlmrl/train/lora.py, vlmrl/train/ulysses.py).
    return [
        f"{what}: not supported by vlmrl yet; {fix}"
        for applies, what, fix in todo
        if applies
    ]


def _why_decoupled(config: Config) -> str:
    """Why the decoupled loss is on when worker.actor.use_decoupled_loss is unset: the asynchronous bound."""
    eta = config.worker.rollout.async_rl.max_head_offpolicyness
    return (
        f"worker.rollout.async_rl.max_head_offpolicyness={eta} (asynchronous training turns the decoupled loss on "
        "when worker.actor.use_decoupled_loss is unset)"
    )
