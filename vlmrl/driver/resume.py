"""Checks on the checkpoint a run starts from, before any worker loads a model.

- **Whole**: the checkpoint's files must match the manifest its save wrote
  (``vlmrl.driver.checkpoint.check_manifest``). A checkpoint without one (an
  older vlmrl's) is loaded only when named in ``trainer.load_checkpoint_path``,
  with a warning; the automatic resume skips it.
- **Trust**: the checkpoint must be writable by its owner only, and its DCP
  metadata must unpickle through the allowlist (vlmrl/train/safe_checkpoint.py).
  The workers check again when they load; this fails the run in seconds rather
  than after the workers start.
- **Same run**: the settings that change what trains (``FINGERPRINTED``:
  model, data, algorithm, losses, batch shape, seeds, rollout kind, reward; every
  other key of the schema is in ``NOT_FINGERPRINTED``) are stored with each
  checkpoint. An automatic resume (``trainer.find_last_checkpoint``) refuses a
  checkpoint whose settings differ, listing the keys; an explicit
  ``trainer.load_checkpoint_path`` says which of the checkpoint's settings this
  run overrides and goes on.
- **Same code**: the user's files the config names (reward function, tools,
  agent, templates; ``vlmrl.driver.user_files``) are hashed into each
  checkpoint; a resume warns, naming the key and the file, for each one whose
  contents changed, and goes on.
- **Same model**: the architecture of the saved model config against the
  configured model's (a local directory or a hub id, resolved through its
  config), and the LoRA settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.config import Config, to_dict
from vlmrl.config.redact import MASK
from vlmrl.driver.checkpoint import MANIFEST, CheckpointError, check_manifest, check_model_matches
from vlmrl.driver.user_files import changed_user_files, user_files
from vlmrl.train.checkpoint import check_lora_matches
from vlmrl.train.safe_checkpoint import UnsafeCheckpoint, check_private, read_metadata_safely

# Every key of the schema is decided here, by the longest key path (a path names its whole subtree) of either
# tuple that it falls under; tests/test_fingerprint_keys.py fails for a key of the schema that falls under
# neither, so a new key is decided when it is added. A key that still falls under neither is fingerprinted: a
# needless refusal names the key, a missed difference would not.
FINGERPRINTED = (
    "data.train_files", "data.prompt_key", "data.answer_key", "data.image_key", "data.video_key",
    "data.image_dir", "data.allow_paths_outside_image_dir", "data.video_fps", "data.max_prompt_length",
    "data.max_response_length", "data.rollout_batch_size", "data.mini_rollout_batch_size", "data.format_prompt",
    "data.override_chat_template", "data.shuffle", "data.seed", "data.min_pixels", "data.max_pixels",
    "data.filter_overlong_prompts", "data.on_bad_sample",
    "algorithm",
    "worker.actor.global_batch_size", "worker.actor.max_grad_norm", "worker.actor.clip_ratio_low",
    "worker.actor.clip_ratio_high", "worker.actor.clip_ratio_dual", "worker.actor.loss_avg_mode",
    "worker.actor.loss_type", "worker.actor.ppo_epochs", "worker.actor.tau_positive",
    "worker.actor.tau_negative", "worker.actor.entropy_coeff", "worker.actor.router_aux_loss_coef",
    "worker.actor.use_decoupled_loss",
    "worker.actor.behaviour_weight_cap", "worker.actor.behaviour_weight_mode", "worker.actor.proximal_log_probs",
    "worker.actor.model", "worker.actor.optim",
    "worker.critic.global_batch_size", "worker.critic.max_grad_norm", "worker.critic.cliprange_value",
    "worker.critic.loss_avg_mode", "worker.critic.ppo_epochs", "worker.critic.model", "worker.critic.optim",
    "worker.rollout.n", "worker.rollout.temperature", "worker.rollout.top_p", "worker.rollout.top_k",
    "worker.rollout.seed", "worker.rollout.limit_images", "worker.rollout.ignore_eos",
    "worker.rollout.workflow", "worker.rollout.workflow_kwargs", "worker.rollout.workflow_timeout",
    "worker.rollout.multi_turn", "worker.rollout.agent", "worker.rollout.agent_options.timeout",
    "worker.rollout.agent_options.on_failure", "worker.rollout.agent_options.max_tokens_per_call",
    "worker.rollout.async_rl",
    # The dtypes and the engine's log-probs decide the default rollout correction (plan.rollout_correction).
    "worker.rollout.dtype", "worker.rollout.calculate_log_probs", "worker.actor.fsdp.torch_dtype",
    "worker.reward.reward_type", "worker.reward.reward_function", "worker.reward.reward_function_kwargs",
    "worker.reward.skip_special_tokens", "worker.reward.timeout", "worker.reward.on_timeout",
    "worker.reward.reward_model",
    "trainer.critic_warmup",
)  # fmt: skip
"""The settings that change what trains: the data and its order, the algorithm, the losses and their
corrections, the batch shape, the models, the optimizers, the sampling, the rollout kind (multi-turn, an
agent, asynchronous), the reward and what a timed-out or failed rollout or reward becomes."""

NOT_FINGERPRINTED = (
    # Speed and memory: the same training up to float rounding.
    "data.filter_overlong_prompts_workers", "worker.hybrid_engine",
    "worker.actor.strategy", "worker.actor.micro_batch_size_per_device_for_update",
    "worker.actor.micro_batch_size_per_device_for_experience", "worker.actor.old_log_prob_pass",
    "worker.actor.padding_free", "worker.actor.share_prompts", "worker.actor.dynamic_batching",
    "worker.actor.max_token_len_per_device_for_update", "worker.actor.max_token_len_per_device_for_experience",
    "worker.actor.ulysses_size", "worker.actor.use_torch_compile", "worker.actor.model.enable_gradient_checkpointing",
    "worker.actor.fsdp", "worker.actor.offload", "worker.ref",
    "worker.critic.strategy", "worker.critic.micro_batch_size_per_device_for_update",
    "worker.critic.micro_batch_size_per_device_for_experience", "worker.critic.padding_free",
    "worker.critic.dynamic_batching", "worker.critic.ulysses_size", "worker.critic.model.enable_gradient_checkpointing",
    "worker.critic.fsdp", "worker.critic.offload",
    "worker.rollout.name", "worker.rollout.gpu_memory_utilization",
    "worker.rollout.enforce_eager", "worker.rollout.enable_chunked_prefill", "worker.rollout.tensor_parallel_size",
    "worker.rollout.max_model_len", "worker.rollout.max_num_batched_tokens",
    "worker.rollout.cpu_kvcache_space_gb", "worker.rollout.free_cache_engine", "worker.rollout.resync_bucket_mb",
    "worker.rollout.agent_options.max_concurrency", "worker.rollout.async_rl.weight_transfer",
    "worker.rollout.multi_turn.tool_processes",
    "worker.reward.num_cpus", "worker.reward.num_workers",
    "worker.reward.reward_model.placement", "worker.reward.reward_model.num_gpus",
    "worker.reward.reward_model.num_cpus", "worker.reward.reward_model.micro_batch_size",
    "worker.reward.reward_model.cpu_kvcache_space_gb", "worker.reward.reward_model.gpu_memory_utilization",
    "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.device",
    # What code may run, the endpoint's and the sandbox's guards against misbehaving agents and rewards, and the
    # reward processes' environment (API keys, masked as *** wherever the config is written, so never compared).
    "worker.actor.model.trust_remote_code", "worker.critic.model.trust_remote_code",
    "worker.rollout.agent_options.host", "worker.rollout.agent_options.port",
    "worker.rollout.agent_options.max_images_per_call", "worker.rollout.agent_options.max_image_pixels",
    "worker.rollout.agent_options.max_call_pixels", "worker.rollout.agent_options.max_connections",
    "worker.rollout.agent_options.header_timeout", "worker.rollout.agent_options.body_timeout",
    "worker.reward.memory_limit_mb", "worker.reward.env", "trainer.warn_unauthenticated_ray",
    # What is validated, logged, printed or watched; the agent's hooks only look on.
    "data.val_files", "data.val_batch_size", "worker.rollout.val_override_config", "worker.rollout.disable_log_stats",
    "worker.rollout.disable_tqdm", "worker.rollout.agent_hooks",
    "trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.output_dir", "trainer.verbose",
    "trainer.val_freq", "trainer.val_before_train", "trainer.val_only", "trainer.val_generations_to_log",
    "trainer.rollout_data_dir",
    "trainer.ray_timeline", "trainer.max_consecutive_skipped_steps", "trainer.fail_without_signal_steps",
    "trainer.max_try_make_batch", "trainer.start_timeout_s", "trainer.step_timeout_s",
    # How long the run goes on, and when, where and what it saves and resumes from.
    "trainer.total_epochs", "trainer.max_steps", "trainer.save_freq", "trainer.save_every_minutes",
    "trainer.save_limit", "trainer.save_model_only", "trainer.save_checkpoint_path", "trainer.load_checkpoint_path",
    "trainer.find_last_checkpoint", "trainer.save_hf_weights",
)  # fmt: skip
"""Settings a user changes and resumes: they change speed or memory, guards, what is logged or validated, how
long the run goes on or how it saves, not what a step trains."""


def decided_by(key: str) -> str | None:
    """The entry of FINGERPRINTED or NOT_FINGERPRINTED that decides ``key`` (the longest that it falls under)."""
    entries = [e for e in FINGERPRINTED + NOT_FINGERPRINTED if key == e or key.startswith(e + ".")]
    return max(entries, key=len) if entries else None


def is_fingerprinted(key: str) -> bool:
    return decided_by(key) not in NOT_FINGERPRINTED


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: tree}


def fingerprint_of(config_dict: dict) -> dict[str, Any]:
    """The settings that change what trains, as flat ``key: value`` pairs (JSON values)."""
    flat: dict[str, Any] = {}
    for section, value in config_dict.items():
        flat.update(_flatten(value, section))
    out = {key: value for key, value in flat.items() if is_fingerprinted(key)}
    return json.loads(json.dumps(out))  # tuples and enums as JSON sees them, to compare with a saved copy


def fingerprint(config: Config) -> dict[str, Any]:
    return fingerprint_of(to_dict(config))


def saved_fingerprint(checkpoint: Path) -> dict[str, Any] | None:
    """The fingerprint stored with a checkpoint (derived from its saved config when it predates fingerprints)."""
    file = checkpoint / "config.json"
    if not file.is_file():
        return None
    saved = json.loads(file.read_text())
    if "fingerprint" in saved:
        return saved["fingerprint"]
    return fingerprint_of(saved["config"]) if "config" in saved else None


def _saved_user_files(checkpoint: Path) -> dict[str, dict[str, str]]:
    file = checkpoint / "config.json"
    return json.loads(file.read_text()).get("user_files", {}) if file.is_file() else {}


# Settings whose values are free-form dicts: an entry only one side has is a difference. For the
# other subtrees a key only one side has is a key of an older or newer vlmrl, and is not compared.
_DICT_VALUED = (
    "worker.reward.reward_function_kwargs",
    "worker.actor.model.override_config",
    "worker.critic.model.override_config",
)


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for each fingerprinted key that differs."""
    lines = []
    for key in sorted(saved.keys() | current.keys()):
        if MASK in (saved.get(key), current.get(key)):
            continue  # a secret (vlmrl.config.redact): not stored, so not compared, and never printed
        if key in saved and key in current:
            if saved[key] != current[key]:
                lines.append(f"{key}: {saved[key]!r} -> {current[key]!r}")
        elif any(key == d or key.startswith(d + ".") for d in _DICT_VALUED):
            if not (saved.get(key, current.get(key)) == {}):  # an empty dict beside entries says nothing more
                lines.append(f"{key}: {saved.get(key, '<unset>')!r} -> {current.get(key, '<unset>')!r}")
    return lines


def check_trusted(checkpoint: Path) -> None:
    """Refuse a checkpoint other users can change, or whose DCP metadata would run code."""
    check_private(checkpoint)
    for role in ("actor", "critic"):
        if (checkpoint / role / ".metadata").is_file():
            read_metadata_safely(checkpoint / role)


def check_resume(checkpoint: Path, config: Config, explicit: bool) -> None:
    """Every check on the checkpoint a run starts from; raises CheckpointError or UnsafeCheckpoint."""
    if not checkpoint.is_dir():
        raise CheckpointError(f"trainer.load_checkpoint_path={checkpoint}: no such checkpoint directory")
    problem = check_manifest(checkpoint)
    if problem is not None:
        if not (explicit and not (checkpoint / MANIFEST).exists()):
            raise CheckpointError(f"refusing to resume from {checkpoint}: {problem}")
        print(f"checkpoint: WARNING: {checkpoint}: {problem}; loading it unverified, as it is named", flush=True)
    check_trusted(checkpoint)
    saved = saved_fingerprint(checkpoint)
    if saved is not None:
        diff = differences(saved, fingerprint(config))
        if diff and not explicit:
            listed = "\n  ".join(diff)
            raise CheckpointError(
                f"refusing to resume from {checkpoint}: it was saved by a run with other settings that change what "
                f"trains (checkpoint -> this run):\n  {listed}\n"
                "Resuming would continue another run's training under this run's name. Either start a new run "
                "(another trainer.experiment_name=..., or trainer.find_last_checkpoint=false), or start from this "
                f"checkpoint on purpose with trainer.load_checkpoint_path={checkpoint} (this run's settings then "
                "override the checkpoint's)."
            )
        if diff:
            listed = "\n  ".join(diff)
            print(
                f"checkpoint: starting from {checkpoint} (trainer.load_checkpoint_path); this run's settings "
                f"override the checkpoint's (checkpoint -> this run):\n  {listed}",
                flush=True,
            )
    changed = changed_user_files(_saved_user_files(checkpoint), user_files(config))
    if changed:
        listed = "\n  ".join(changed)
        print(
            f"checkpoint: WARNING: {checkpoint} was trained with other contents of these files (key: file); "
            f"this run goes on with the files as they are now:\n  {listed}",
            flush=True,
        )
    model = config.worker.actor.model
    check_model_matches(checkpoint, model.model_path)
    check_lora_matches(checkpoint / "actor", model.lora if model.lora.rank > 0 else None)


__all__ = [
    "FINGERPRINTED",
    "NOT_FINGERPRINTED",
    "UnsafeCheckpoint",
    "check_resume",
    "check_trusted",
    "decided_by",
    "differences",
    "fingerprint",
    "is_fingerprinted",
]
