"""Checks on the checkpoint a run starts from, before any worker loads a model.

- **Whole**: the checkpoint's files must match the manifest its save wrote
  (``vlmrl.driver.checkpoint.check_manifest``). A checkpoint without one (an
  older vlmrl's) is loaded only when named in ``trainer.load_checkpoint_path``,
  with a warning; the automatic resume skips it.
- **Trust**: the checkpoint must be writable by its owner only, and its DCP
  metadata must unpickle through the allowlist (vlmrl/train/safe_checkpoint.py).
  The workers check again when they load; this fails the run in seconds rather
  than after the workers start.
- **Same run**: the settings that change what trains (``FINGERPRINT_KEYS``:
  model, data, algorithm, batch shape, seeds, reward) are stored with each
  checkpoint. An automatic resume (``trainer.find_last_checkpoint``) refuses a
  checkpoint whose settings differ, listing the keys; an explicit
  ``trainer.load_checkpoint_path`` says which of the checkpoint's settings this
  run overrides and goes on.
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
from vlmrl.train.checkpoint import check_lora_matches
from vlmrl.train.safe_checkpoint import UnsafeCheckpoint, check_private, read_metadata_safely

# Key paths (a path names its whole subtree) of the settings that change what a run trains.
# Keys that only change speed or memory (micro-batch sizes, padding-free, offload, FSDP),
# what is logged or validated, and how long the run goes on (total_epochs, max_steps) are not here:
# changing them and resuming is what users do.
FINGERPRINT_KEYS = (
    "data.train_files", "data.prompt_key", "data.answer_key", "data.image_key", "data.video_key",
    "data.image_dir", "data.video_fps", "data.max_prompt_length", "data.max_response_length",
    "data.rollout_batch_size", "data.mini_rollout_batch_size", "data.format_prompt",
    "data.override_chat_template", "data.shuffle", "data.seed", "data.min_pixels", "data.max_pixels",
    "data.filter_overlong_prompts", "data.on_bad_sample",
    "algorithm",
    "worker.actor.global_batch_size", "worker.actor.max_grad_norm", "worker.actor.clip_ratio_low",
    "worker.actor.clip_ratio_high", "worker.actor.clip_ratio_dual", "worker.actor.loss_avg_mode",
    "worker.actor.loss_type", "worker.actor.ppo_epochs", "worker.actor.tau_positive",
    "worker.actor.tau_negative", "worker.actor.entropy_coeff", "worker.actor.model.model_path",
    "worker.actor.model.tokenizer_path", "worker.actor.model.override_config",
    "worker.actor.model.freeze_vision_tower", "worker.actor.model.lora", "worker.actor.optim",
    "worker.critic.global_batch_size", "worker.critic.max_grad_norm", "worker.critic.cliprange_value",
    "worker.critic.loss_avg_mode", "worker.critic.ppo_epochs", "worker.critic.model.model_path",
    "worker.critic.model.override_config", "worker.critic.optim",
    "worker.rollout.n", "worker.rollout.temperature", "worker.rollout.top_p", "worker.rollout.top_k",
    "worker.rollout.seed", "worker.rollout.limit_images", "worker.rollout.ignore_eos",
    "worker.rollout.multi_turn",
    "worker.reward.reward_type", "worker.reward.reward_function", "worker.reward.reward_function_kwargs",
    "worker.reward.skip_special_tokens", "worker.reward.reward_model",
    "trainer.critic_warmup",
)  # fmt: skip


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: tree}


def _lookup(tree: dict, path: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def fingerprint_of(config_dict: dict) -> dict[str, Any]:
    """The settings that change what trains, as flat ``key: value`` pairs (JSON values)."""
    out: dict[str, Any] = {}
    for path in FINGERPRINT_KEYS:
        found, value = _lookup(config_dict, path)
        if found:
            out.update(_flatten(value, path))
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
    model = config.worker.actor.model
    check_model_matches(checkpoint, model.model_path)
    check_lora_matches(checkpoint / "actor", model.lora if model.lora.rank > 0 else None)


__all__ = ["FINGERPRINT_KEYS", "UnsafeCheckpoint", "check_resume", "check_trusted", "differences", "fingerprint"]
