"""Numbers one at a time and batch arithmetic: bounds, sampling settings, batch sizes that split into whole
mini-batches, per-worker shares and micro-batches, and the validation schedule.
"""

from __future__ import annotations

from vlmrl.config import Config
from vlmrl.plan import uses_critic, world_size

__all__ = ["batch_problems", "range_problems", "sampling_problems", "schedule_problems", "validation_problems"]


def range_problems(config: Config) -> list[str]:
    """Single-value bounds."""
    problems = []
    data, algo, trainer = config.data, config.algorithm, config.trainer
    actor, rollout = config.worker.actor, config.worker.rollout
    at_least_one = [
        ("data.rollout_batch_size", data.rollout_batch_size),
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("data.filter_overlong_prompts_workers", data.filter_overlong_prompts_workers),
        ("worker.rollout.n", rollout.n),
        ("worker.rollout.tensor_parallel_size", rollout.tensor_parallel_size),
        ("worker.rollout.resync_bucket_mb", rollout.resync_bucket_mb),
        ("worker.actor.global_batch_size", actor.global_batch_size),
        (
            "worker.actor.micro_batch_size_per_device_for_update",
            actor.micro_batch_size_per_device_for_update,
        ),
        (
            "worker.actor.micro_batch_size_per_device_for_experience",
            actor.micro_batch_size_per_device_for_experience,
        ),
        ("worker.actor.ppo_epochs", actor.ppo_epochs),
        ("worker.actor.ulysses_size", actor.ulysses_size),
        ("trainer.total_epochs", trainer.total_epochs),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node),
        ("trainer.nnodes", trainer.nnodes),
    ]
    for key, value in at_least_one:
        if value < 1:
            problems.append(f"{key}={value}: must be at least 1")
    for key, value in (
        ("data.mini_rollout_batch_size", data.mini_rollout_batch_size),
        ("worker.rollout.max_model_len", rollout.max_model_len),
        ("trainer.max_steps", trainer.max_steps),
    ):
        if value is not None and value < 1:
            problems.append(f"{key}={value}: must be at least 1, or unset")
    if data.val_batch_size != -1 and data.val_batch_size < 1:
        problems.append(
            f"data.val_batch_size={data.val_batch_size}: must be at least 1, or -1 for the whole validation set"
        )
    longest = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and 1 <= rollout.max_model_len < longest:
        problems.append(
            f"worker.rollout.max_model_len={rollout.max_model_len} is shorter than data.max_prompt_length + "
            f"data.max_response_length = {longest}: the engine could not hold a full sequence; set it to at least "
            f"{longest}, or null"
        )
    for which in ("update", "experience"):
        budget = getattr(actor, f"max_token_len_per_device_for_{which}")
        if budget is not None and budget < longest:
            problems.append(
                f"worker.actor.max_token_len_per_device_for_{which}={budget} is shorter than data.max_prompt_length "
                f"+ data.max_response_length = {longest}: a micro-batch must hold a full sequence; set it to at "
                f"least {longest}, or null"
            )
    if data.min_pixels > data.max_pixels:
        problems.append(
            f"data.min_pixels={data.min_pixels} > data.max_pixels={data.max_pixels}: swap them"
        )
    if not data.video_fps > 0:
        problems.append(f"data.video_fps={data.video_fps}: must be positive")
    for key, value in (("algorithm.gamma", algo.gamma), ("algorithm.lam", algo.lam)):
        if not 0 <= value <= 1:
            problems.append(f"{key}={value}: must be in [0, 1]")
    if not 0 < actor.clip_ratio_low < 1:
        problems.append(
            f"worker.actor.clip_ratio_low={actor.clip_ratio_low}: must be in (0, 1)"
        )
    # Written as "not (valid)" so that NaN, for which every comparison is false, is refused too.
    if not actor.clip_ratio_high > 0:
        problems.append(
            f"worker.actor.clip_ratio_high={actor.clip_ratio_high}: must be positive"
        )
    if not actor.clip_ratio_dual > 1:
        problems.append(
            f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual}: must be greater than 1"
        )
    for key, value in (
        ("worker.actor.max_grad_norm", actor.max_grad_norm),
        ("worker.actor.tau_positive", actor.tau_positive),
        ("worker.actor.tau_negative", actor.tau_negative),
        ("worker.actor.optim.lr", actor.optim.lr),
    ):
        if not value > 0:
            problems.append(f"{key}={value}: must be positive")
    if not actor.router_aux_loss_coef >= 0:
        problems.append(f"worker.actor.router_aux_loss_coef={actor.router_aux_loss_coef}: must be 0 (off) or more")
    problems.extend(optim_problems("worker.actor", actor.optim))
    if uses_critic(config):
        # The critic trains too: the same bounds (its skipped steps fail the run like the actor's).
        critic = config.worker.critic
        for key, value in (
            ("worker.critic.max_grad_norm", critic.max_grad_norm),
            ("worker.critic.optim.lr", critic.optim.lr),
        ):
            if not value > 0:
                problems.append(f"{key}={value}: must be positive")
        problems.extend(optim_problems("worker.critic", critic.optim))
    if trainer.step_timeout_s is not None and not trainer.step_timeout_s > 0:
        problems.append(
            f"trainer.step_timeout_s={trainer.step_timeout_s}: must be a positive number of seconds, or null to wait "
            "forever"
        )
    if not trainer.start_timeout_s > 0:
        problems.append(f"trainer.start_timeout_s={trainer.start_timeout_s}: must be a positive number of seconds")
    if not (trainer.max_consecutive_skipped_steps == -1 or trainer.max_consecutive_skipped_steps >= 1):
        problems.append(
            f"trainer.max_consecutive_skipped_steps={trainer.max_consecutive_skipped_steps}: must be at least 1, "
            "or -1 to never stop a run for skipped updates"
        )
    if trainer.fail_without_signal_steps < 0:
        problems.append(
            f"trainer.fail_without_signal_steps={trainer.fail_without_signal_steps}: must be 0 (never fail, only "
            "warn) or a number of steps in a row without a learning signal that fails the run"
        )
    problems.extend(
        sampling_problems(
            "worker.rollout", rollout.temperature, rollout.top_p, rollout.top_k, None
        )
    )
    for key, value in (
        ("worker.rollout.cpu_kvcache_space_gb", rollout.cpu_kvcache_space_gb),
        ("worker.reward.reward_model.cpu_kvcache_space_gb", config.worker.reward.reward_model.cpu_kvcache_space_gb),
    ):
        if not value > 0:
            problems.append(f"{key}={value}: must be more than 0 (GiB; 0.125 is 128 MiB)")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        problems.append(
            f"worker.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: must be in (0, 1]"
        )
    if trainer.max_try_make_batch == 0 or trainer.max_try_make_batch < -1:
        problems.append(
            f"trainer.max_try_make_batch={trainer.max_try_make_batch}: must be at least 1, or -1 for no limit"
        )
    if trainer.critic_warmup < 0:
        problems.append(
            f"trainer.critic_warmup={trainer.critic_warmup}: must be 0 or more"
        )
    return problems


def optim_problems(section: str, optim) -> list[str]:
    """AdamW's betas and weight decay (NaN-safe)."""
    problems = []
    betas = optim.betas
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(f"{section}.optim.betas={betas}: give two numbers in [0, 1), e.g. [0.9, 0.999]")
    if not optim.weight_decay >= 0:
        problems.append(f"{section}.optim.weight_decay={optim.weight_decay}: must be 0 or more")
    return problems


def schedule_problems(config: Config) -> list[str]:
    """The learning-rate schedule keys of each trained model: shares in [0, 1], whole warm-up steps."""
    problems = []
    sections = [("worker.actor", config.worker.actor.optim)]
    if uses_critic(config):
        sections.append(("worker.critic", config.worker.critic.optim))
    for section, optim in sections:
        if not 0 <= optim.lr_warmup_ratio <= 1:
            problems.append(
                f"{section}.optim.lr_warmup_ratio={_num(optim.lr_warmup_ratio)}: must be in [0, 1] (the share of "
                "the training steps spent warming up)"
            )
        if optim.lr_warmup_steps is not None and optim.lr_warmup_steps < 0:
            problems.append(
                f"{section}.optim.lr_warmup_steps={optim.lr_warmup_steps}: must be 0 or more, or null to use "
                "lr_warmup_ratio"
            )
        if optim.min_lr_ratio is not None and not 0 <= optim.min_lr_ratio <= 1:
            problems.append(
                f"{section}.optim.min_lr_ratio={_num(optim.min_lr_ratio)}: must be in [0, 1] (the cosine "
                "schedule's last rate as a share of lr), or null for 0"
            )
    return problems


def _num(value: float) -> str:
    """A number as the user would have typed it (-1, not -1.0)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def sampling_problems(prefix: str, temperature, top_p, top_k, n) -> list[str]:
    rules = [  # (key, value, valid?, what it must be)
        ("temperature", temperature, lambda v: v >= 0, "a number >= 0 (0 is greedy)"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", top_k, lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"),
        ("n", n, lambda v: v >= 1, "an integer >= 1"),
    ]
    return [
        f"{prefix}.{key}={_num(value)}: must be {what}"
        for key, value, ok, what in rules
        if value is not None and not ok(value)
    ]


def batch_problems(config: Config) -> list[str]:
    """Batch sizes must split into whole mini-batches, whole per-worker shares and whole micro-batches."""
    problems = []
    data, actor, n = config.data, config.worker.actor, config.worker.rollout.n
    if min(data.rollout_batch_size, actor.global_batch_size, n, world_size(config)) < 1:
        return problems  # reported by range_problems
    if data.rollout_batch_size % actor.global_batch_size:
        problems.append(
            f"data.rollout_batch_size={data.rollout_batch_size} is not a multiple of "
            f"worker.actor.global_batch_size={actor.global_batch_size}: each step's prompts must split into "
            "whole update mini-batches; make rollout_batch_size a multiple of global_batch_size"
        )
    problems.extend(
        _shares(
            "worker.actor",
            data.rollout_batch_size,
            actor.global_batch_size,
            n,
            actor.micro_batch_size_per_device_for_update,
            config,
        )
    )
    if uses_critic(config):
        critic = config.worker.critic
        if (
            critic.global_batch_size >= 1
            and data.rollout_batch_size % critic.global_batch_size
        ):
            problems.append(
                f"data.rollout_batch_size={data.rollout_batch_size} is not a multiple of "
                f"worker.critic.global_batch_size={critic.global_batch_size}: each step's prompts must split into "
                "whole critic mini-batches; make rollout_batch_size a multiple of it"
            )
        for key, value in (
            ("worker.critic.global_batch_size", critic.global_batch_size),
            (
                "worker.critic.micro_batch_size_per_device_for_update",
                critic.micro_batch_size_per_device_for_update,
            ),
            (
                "worker.critic.micro_batch_size_per_device_for_experience",
                critic.micro_batch_size_per_device_for_experience,
            ),
            ("worker.critic.ppo_epochs", critic.ppo_epochs),
        ):
            if value < 1:
                problems.append(f"{key}={value}: must be at least 1")
        if not critic.cliprange_value > 0:  # NaN too
            problems.append(
                f"worker.critic.cliprange_value={critic.cliprange_value}: must be positive"
            )
        if critic.global_batch_size >= 1:
            problems.extend(
                _shares(
                    "worker.critic",
                    None,
                    critic.global_batch_size,
                    n,
                    critic.micro_batch_size_per_device_for_update,
                    config,
                )
            )
    return problems


def _shares(
    section: str,
    rollout_batch_size: int | None,
    global_batch_size: int,
    n: int,
    micro: int,
    config: Config,
) -> list[str]:
    problems = []
    world = world_size(config)
    checks = [(f"{section}.global_batch_size", global_batch_size * n)]
    if rollout_batch_size is not None:
        checks.insert(0, ("data.rollout_batch_size", rollout_batch_size * n))
    for key, samples in checks:
        if samples % world:
            problems.append(
                f"{key} x worker.rollout.n = {samples} samples do not split evenly over {world} worker(s) "
                "(trainer.n_gpus_per_node x trainer.nnodes); make the product a multiple of the workers"
            )
    # The workers of a Ulysses group (worker.actor.ulysses_size of them) hold the same rows: one share per group.
    sp = config.worker.actor.ulysses_size
    shares, per = (world // sp, "Ulysses group") if sp > 1 and world % sp == 0 else (world, "worker")
    per_worker = global_batch_size * n // shares
    if micro >= 1 and per_worker >= 1 and per_worker % micro:
        problems.append(
            f"{section}.micro_batch_size_per_device_for_update={micro} does not divide the {per_worker} samples "
            f"each {per} gets per update (global_batch_size x n / {per}s); pick a divisor of {per_worker}"
        )
    return problems



def validation_problems(config: Config) -> list[str]:
    problems = []
    trainer, override = config.trainer, config.worker.rollout.val_override_config
    if trainer.val_freq == 0 or trainer.val_freq < -1:
        problems.append(
            f"trainer.val_freq={trainer.val_freq}: must be at least 1, or -1 to validate only at the end"
        )
    if trainer.val_generations_to_log < 0:
        problems.append(
            f"trainer.val_generations_to_log={trainer.val_generations_to_log}: must be 0 or more"
        )
    if trainer.val_only and not config.data.val_files:
        problems.append("trainer.val_only=true needs data.val_files")
    problems.extend(
        sampling_problems(
            "worker.rollout.val_override_config",
            override.temperature,
            override.top_p,
            override.top_k,
            override.n,
        )
    )
    return problems
